"""fp8 training scenarios: a small model trained for real under an fp8 recipe, every cast traced.

An fp8 training spec::

    description = "torchao tensorwise Float8Linear MLP, 6 steps"
    steps = 6

    [fp8_training]
    model = "mlp"                         # a key of MODELS
    recipe = "tensorwise"                 # a key of RECIPES: torchao's Float8LinearConfig recipe name
    seed = 0                              # the weights' and the data's seed

The real run (torchao's Float8Linear, trained on the CPU) records, per step, every fp8 cast's amaxes,
scales and a digest of its codes, named ``layer0.input``, ``layer1.weight``, ...; its golden trace is
fpemu's model of the recipe (:class:`fpemu.scalers.fp8_recipes.TorchaoScaling`) on the tensors such a
run cast.  Those tensors come from torch's own float32 arithmetic, so a golden holds for the package
versions in its metadata (docs/fp8_recipes.md, "fp8 training specs").
"""

from __future__ import annotations

import dataclasses

from fpemu.adapters import FP8_TRAINING
from fpemu.kinds.scenario import Implementation, ScenarioBase
from fpemu.kinds.schema import build_scenario, record_fields

FP8_TRAINING_ADAPTER = "torchao_float8_linear"  # fpemu.adapters: the real run every such spec drives


@dataclasses.dataclass(frozen=True)
class Fp8TrainingModel:
    """A model an fp8 training spec can train (torch.nn layers converted to Float8Linear).

    Attributes:
      sizes: the features of each Linear layer's input, then of the last layer's output (no biases,
        ReLU between the layers).
      batch: rows of each step's seeded randn batch; lr: SGD's learning rate (MSE loss on randn targets).
    """

    sizes: tuple
    batch: int
    lr: float

    @property
    def description(self) -> str:
        layers = "-ReLU-".join(f"Linear({a},{b})" for a, b in zip(self.sizes, self.sizes[1:]))
        return f"{layers}, no bias, batch {self.batch}, MSE on randn targets, SGD lr {self.lr}"


# The one table of trainable models and of recipes (torchao names; each casts six tensors per layer per step).
MODELS = {"mlp": Fp8TrainingModel(sizes=(16, 32, 16), batch=8, lr=0.05),
          "mlp_wide": Fp8TrainingModel(sizes=(64, 128, 64), batch=16, lr=0.02)}
RECIPES = ("tensorwise", "rowwise")
_KEYS = {"model", "recipe", "seed"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fp8TrainingScenario(ScenarioBase):
    """A model trained ``steps`` steps under a torchao fp8 recipe (see :func:`fpemu.specs.load_spec`).

    Attributes:
      model: a key of :data:`MODELS`; recipe: one of :data:`RECIPES`; seed: the weights' and data's seed.
      golden_needs: its golden is fpemu's model on a real run's tensors, so it needs that run's adapter.
    """

    model: str
    recipe: str
    seed: int
    golden_needs = FP8_TRAINING_ADAPTER

    @property
    def profile(self) -> str:
        """fpemu's model of the recipe the run's casts are compared with."""
        return f"torchao_{self.recipe}"

    @property
    def params(self) -> dict:
        """Everything that decides the run, as its traces' metadata names it."""
        return {"model": self.model, "model_description": MODELS[self.model].description, "recipe": self.recipe,
                "seed": self.seed, "steps": self.steps}

    def implementation(self, name: str) -> Implementation:
        return self.declared(name) or Implementation(name, {})


def parse_fp8_training_spec(check, raw: dict, text: str, path: str) -> Fp8TrainingScenario:
    """Validate a spec with an [fp8_training] table (``check``: the loader's checker, which names the file)."""
    for key in ("scaler", "overflow", "step", "amax", "implementations"):
        if key in raw:
            check.attempt(check.fail, key, "an [fp8_training] scenario trains its own model under its recipe "
                                           f"and drives {FP8_TRAINING_ADAPTER}; remove this table")
    steps = (check.attempt(check.integer, raw["steps"], "steps", 1) if "steps" in raw
             else check.attempt(check.fail, "steps", "missing required key"))
    table = check.attempt(check.table, raw["fp8_training"], "fp8_training", _KEYS) or {}
    model = check.attempt(check.choice, table.get("model", "mlp"), "fp8_training.model", tuple(MODELS))
    recipe = check.attempt(check.choice, table.get("recipe"), "fp8_training.recipe", RECIPES)
    seed = check.attempt(check.integer, table.get("seed", 0), "fp8_training.seed", 0)
    record = check.attempt(record_fields, check, raw, FP8_TRAINING)
    check.raise_errors()
    return build_scenario(check, Fp8TrainingScenario, raw, text, path, steps=steps, model=model, recipe=recipe, seed=seed,
                     implementations=(Implementation(FP8_TRAINING_ADAPTER, {}),), record=record)
