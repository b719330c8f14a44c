"""A framework's refusal of an argument it used to take is `api changed`, whatever it raises: Keras 3.12+
refuses LossScaleOptimizer(clipnorm=) with a ValueError (checked on the installed Keras, 3.15.1 here)."""

import pytest

from fpemu.compare.diff import API_CHANGED, CANNOT_RUN
from fpemu.errors import RefusedCall
from fpemu.harness.jobs import classify_failure, job_failure
from fpemu.specs import load_specs

SPEC = "matrices/specs/api_keras_clipnorm.toml"


@pytest.mark.fpemu_keras
def test_keras_refusing_clipnorm_is_an_api_change_naming_the_valueerror():
    from fpemu.adapters.keras_scaler import record_keras_clipnorm
    with pytest.raises(RefusedCall) as refused:
        record_keras_clipnorm([False], {}, "cpu")
    assert isinstance(refused.value.__cause__, ValueError)
    (scenario,) = load_specs([SPEC])
    impl = next(i for i in scenario.implementations if i.name == "keras_clipnorm")
    verdict = job_failure(scenario, impl, refused.value)
    assert verdict.status == API_CHANGED
    assert verdict.note.startswith("ValueError in keras ") and "does not support `clipnorm`" in verdict.note
    assert "(raised at keras/src/optimizers/loss_scale_optimizer.py:" in verdict.note


def test_a_refusal_raised_in_an_isolated_environment_is_an_api_change():
    from fpemu.environments import EnvironmentCallError
    remote = "Traceback (most recent call last):\n  ...\nfpemu.errors.RefusedCall: LossScaleOptimizer(clipnorm=) refused\n"
    assert classify_failure(EnvironmentCallError("refused", remote)) == API_CHANGED
    other = remote.replace("fpemu.errors.RefusedCall", "ValueError")
    assert classify_failure(EnvironmentCallError("refused", other)) == CANNOT_RUN
