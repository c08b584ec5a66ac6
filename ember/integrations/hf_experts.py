"""ember's fused MoE as a transformers experts backend: ``experts_implementation="ember"``.

transformers 5 routes every ``@use_experts_implementation`` experts module (Qwen3-MoE, Qwen3.5-MoE,
LFM2-MoE, ...) through a registry of forward functions taking ``(hidden_states [T, H], top_k_index
[T, k], top_k_weights [T, k])`` with the stacked weights ``gate_up_proj [E, 2I, H]`` and
``down_proj [E, H, I]``, exactly ``ember.ops.moe_experts``'s layout. Registering ember there speeds
up a stock transformers model without converting it.

Example:
    >>> from ember.integrations import hf_experts
    >>> hf_experts.enable(model)            # or: register(); model.set_experts_implementation("ember")
    >>> model.generate(ids, max_new_tokens=32)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "ember"


def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The registered forward: checks the module's layout, then one ``ember.ops.moe_experts`` call."""
    from ember.ops.moe import moe_experts
    unsupported = []
    if not getattr(self, "has_gate", True):
        unsupported.append("no gate projection")
    if not getattr(self, "is_concatenated", True):
        unsupported.append("interleaved gate/up rows")
    if getattr(self, "is_transposed", False):
        unsupported.append("transposed weights")
    if getattr(self, "has_bias", False):
        unsupported.append("biases")
    act = getattr(self, "act_fn", F.silu)
    if not (act is F.silu or isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"):
        unsupported.append(f"activation {act!r} (ember's experts compute SiLU)")
    if unsupported:
        raise ValueError(f"experts_implementation='ember': {type(self).__name__} has {', '.join(unsupported)}; "
                         "use transformers' 'eager' or 'grouped_mm' for this model")
    # check=False: the router produced the ids, and a range check would sync the device every layer
    return moe_experts(hidden_states, self.gate_up_proj, self.down_proj, top_k_weights.float(), top_k_index,
                       check=False)


def register() -> None:
    """Make ``experts_implementation="ember"`` valid for every transformers model."""
    from transformers.integrations.moe import ExpertsInterface
    ExpertsInterface.register(NAME, experts_forward)


def enable(model) -> None:
    """Register the backend and switch ``model`` (a transformers PreTrainedModel) to it."""
    register()
    model.set_experts_implementation(NAME)
