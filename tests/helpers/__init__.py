"""Code shared by the tests (importable as ``helpers.xxx``: ``tests/`` is on ``sys.path``
through ``tests/conftest.py``): test doubles, data builders and checks that more than one
test file uses. Fixtures shared by all tests stay in ``tests/conftest.py``."""
