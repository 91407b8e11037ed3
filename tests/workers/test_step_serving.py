"""The transfer endpoint is served between layers of a step once the interval passed
since the step began or since it was last served (a fake clock and counter)."""

from __future__ import annotations

from memserve.workers.engine.step_plan import StepPlan
from memserve.workers.step_serving import ServeBetweenLayers


def test_serves_after_a_layer_once_the_interval_passed():
    now = [0.0]
    served: list[float] = []
    hooks = ServeBetweenLayers(lambda: served.append(now[0]), interval_s=0.5, clock=lambda: now[0])
    now[0] = 5.0  # idle between steps: the loop served the endpoint just before this step
    step = hooks.for_step(StepPlan())
    for layer, at in enumerate((5.25, 5.375, 5.5, 5.75, 6.0, 6.625)):
        now[0] = at
        step.before_layer(layer)
        step.after_layer(layer)
    assert served == [5.5, 6.0, 6.625]  # 0.5 s after the step began, then 0.5 s or more after each serve
    now[0] = 7.0
    hooks.for_step(StepPlan()).after_layer(0)  # a new step starts the interval again
    assert served == [5.5, 6.0, 6.625]
