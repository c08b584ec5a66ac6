"""``ember.train.patch(model)``: swap ember's training ops into one transformers model instance.

What changes (each on the module instance: its ``forward`` attribute is set, the class is untouched,
so other models in the process keep transformers' code; ``unpatch`` deletes the attribute again):

* every RMSNorm module (the decoder's, the final norm, Qwen3's q/k norms) -> ``ember.ops.rmsnorm``
  (Qwen3.5's ``(1 + weight)`` norms pass ``1 + weight`` in float32, as the module computes it);
* the dense MLPs' ``down(act(gate(x)) * up(x))`` -> ``down(ember.ops.swiglu([gate(x), up(x)]))``;
* the MoE blocks' experts -> ``ember.ops.moe_experts_train`` (sorted grouped GEMMs, with backward);
* the causal LM's ``labels`` path -> ``ember.ops.linear_cross_entropy`` of the last hidden state and
  ``lm_head.weight``, never materialising the logits: HF's shift by one (or its ``shift_labels``),
  ``ignore_index`` -100, the mean over counted tokens or the sum over ``num_items_in_batch`` when the
  trainer passes it, and the router's auxiliary loss where the config asks for it. With labels the
  output's ``logits`` is None; without labels the original forward runs.

Routers, attention, embeddings, LFM2's short convolutions and Qwen3.5's gated DeltaNet stay stock.
"""
from __future__ import annotations

import sys
import types

import torch
import torch.nn.functional as F

_STATE = "_ember_train_patch"  # attribute on the patched model: [(module, previous forward or _NONE)]
_NONE = object()


class _Family:
    def __init__(self, norm, norm_offset, mlp, mlp_proj, experts):
        self.norm, self.norm_offset, self.mlp, self.mlp_proj, self.experts = norm, norm_offset, mlp, mlp_proj, experts


# model_type -> the module classes (by name) that patch swaps, and the dense MLP's (gate, up, down)
FAMILIES = {
    "qwen3": _Family("Qwen3RMSNorm", False, "Qwen3MLP", ("gate_proj", "up_proj", "down_proj"), None),
    "qwen3_moe": _Family("Qwen3MoeRMSNorm", False, "Qwen3MoeMLP", ("gate_proj", "up_proj", "down_proj"),
                         "Qwen3MoeExperts"),
    "lfm2_moe": _Family("Lfm2MoeRMSNorm", False, "Lfm2MoeMLP", ("w1", "w3", "w2"), "Lfm2MoeExperts"),
    "qwen3_5_moe_text": _Family("Qwen3_5MoeRMSNorm", True, "Qwen3_5MoeMLP", ("gate_proj", "up_proj", "down_proj"),
                                "Qwen3_5MoeExperts"),
}
CAUSAL_LM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Lfm2MoeForCausalLM", "Qwen3_5MoeForCausalLM")


def _family(model):
    cfg = getattr(model, "config", None)
    model_type = getattr(cfg, "model_type", None)
    if model_type == "qwen3_5_moe":  # the multimodal wrapper's config: the text model is what trains
        model_type = "qwen3_5_moe_text"
    if model_type not in FAMILIES:
        raise ValueError(f"model: ember.train.patch supports the transformers model types "
                         f"{sorted(FAMILIES)}, got {model_type!r} ({type(model).__name__})")
    return FAMILIES[model_type]


def _is_silu(act) -> bool:
    return act is F.silu or isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"


# ----------------------------------------------------------------------------- the swapped forwards
def _norm_forward(self, hidden_states):
    from ember.ops import rmsnorm
    eps = getattr(self, "variance_epsilon", getattr(self, "eps", 1e-6))
    return rmsnorm(hidden_states, self.weight, eps)


def _offset_norm_forward(self, hidden_states):
    from ember.ops import rmsnorm
    # the module multiplies by (1 + weight) in float32 before its one rounding
    return rmsnorm(hidden_states, 1.0 + self.weight.float(), self.eps)


def _mlp_forward(self, x):
    from ember.ops import swiglu
    gate, up, down = (getattr(self, n) for n in self._ember_proj)
    # one [.., 2I] gate-then-up tensor for swiglu: an activation copy, not a per-step weight concat
    return down(swiglu(torch.cat([gate(x), up(x)], dim=-1)))


def _experts_forward(self, hidden_states, top_k_index, top_k_weights):
    from ember.ops import moe_experts_train
    # check=False: the router made the ids, and a range check would sync the device every layer
    return moe_experts_train(hidden_states, self.gate_up_proj, self.down_proj, top_k_weights, top_k_index,
                             check=False)


def causal_lm_loss(hidden, lm_weight, labels=None, *, lm_bias=None, shift_labels=None, num_items_in_batch=None,
                   ignore_index=-100):
    """HF's ``ForCausalLMLoss`` on ``lm_head(hidden)`` without the logits: targets ``labels`` shifted
    left by one (the last position ignored) unless ``shift_labels`` is given; mean over non-ignored
    targets, or sum / ``num_items_in_batch``.

    Example:
        >>> loss = causal_lm_loss(torch.randn(2, 5, 64), torch.randn(100, 64), torch.randint(100, (2, 5)))
    """
    from ember.ops import linear_cross_entropy
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    H = hidden.shape[-1]
    target = shift_labels.reshape(-1).to(hidden.device)
    if num_items_in_batch is None:
        return linear_cross_entropy(hidden.reshape(-1, H), lm_weight, target, bias=lm_bias, ignore_index=ignore_index)
    loss = linear_cross_entropy(hidden.reshape(-1, H), lm_weight, target, bias=lm_bias, ignore_index=ignore_index,
                                reduction="sum")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def _causal_lm_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                       inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
    original = type(self).forward.__get__(self)
    if labels is None and kwargs.get("shift_labels") is None:
        return original(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                        logits_to_keep=logits_to_keep, **kwargs)
    moe = hasattr(self, "router_aux_loss_coef")
    model_kw = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache)
    router = False
    if moe:
        router = kwargs.pop("output_router_logits", None)
        router = bool(router if router is not None else getattr(self.config, "output_router_logits", False))
        model_kw["output_router_logits"] = router
    shift_labels = kwargs.pop("shift_labels", None)
    ignore_index = kwargs.pop("ignore_index", -100)
    outputs = self.model(**model_kw, **kwargs)  # HF passes the same kwargs (num_items_in_batch too) here
    loss = causal_lm_loss(outputs.last_hidden_state, self.lm_head.weight, labels, lm_bias=self.lm_head.bias,
                          shift_labels=shift_labels, num_items_in_batch=kwargs.get("num_items_in_batch"),
                          ignore_index=ignore_index)
    common = dict(loss=loss, logits=None, past_key_values=outputs.past_key_values,
                  hidden_states=outputs.hidden_states, attentions=outputs.attentions)
    if not moe:
        from transformers.modeling_outputs import CausalLMOutputWithPast
        return CausalLMOutputWithPast(**common)
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast
    aux_loss = None
    if router:
        balance = sys.modules[type(self).__module__].load_balancing_loss_func
        aux_loss = balance(outputs.router_logits, self.num_experts, self.num_experts_per_tok, attention_mask)
        loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
    return MoeCausalLMOutputWithPast(**(common | dict(loss=loss)), aux_loss=aux_loss, router_logits=outputs.router_logits)


# ----------------------------------------------------------------------------- patch / unpatch
def _plan(model, fam):
    """[(module, forward)] for every module patch swaps; raises before anything is changed."""
    plan = []
    for name, m in model.named_modules():
        cls = type(m).__name__
        if cls == fam.norm:
            plan.append((m, _offset_norm_forward if fam.norm_offset else _norm_forward))
        elif cls == fam.mlp:
            if not _is_silu(getattr(m, "act_fn", F.silu)):
                raise ValueError(f"model: {name} ({cls}) uses activation {m.act_fn!r}; ember.ops.swiglu is SiLU only")
            plan.append((m, _mlp_forward))
        elif fam.experts is not None and cls == fam.experts:
            bad = [what for what, flag in (("no gate", not getattr(m, "has_gate", True)),
                                           ("interleaved gate/up", not getattr(m, "is_concatenated", True)),
                                           ("transposed weights", getattr(m, "is_transposed", False)),
                                           ("biases", getattr(m, "has_bias", False)),
                                           ("a non-SiLU activation", not _is_silu(getattr(m, "act_fn", F.silu))))
                   if flag]
            if bad:
                raise ValueError(f"model: {name} ({cls}) has {', '.join(bad)}; ember.ops.moe_experts_train computes "
                                 "SiLU experts with [E, 2I, H] gate-then-up weights")
            plan.append((m, _experts_forward))
        elif cls in CAUSAL_LM:
            plan.append((m, _causal_lm_forward))
    return plan


def patch(model):
    """Swap ember's training ops into ``model`` (a transformers Qwen3, Qwen3-MoE, LFM2-MoE or
    Qwen3.5-MoE model, any dtype or device) in place and return it. Patching a patched model does
    nothing. Works with ``torch.compile`` and ``model.gradient_checkpointing_enable()``.

    Example:
        >>> model = ember.train.patch(transformers.AutoModelForCausalLM.from_pretrained(path))
        >>> model(input_ids, labels=input_ids).loss.backward()   # no [tokens, vocab] logits
        >>> ember.train.unpatch(model)                          # transformers' forwards again
    """
    if getattr(model, _STATE, None) is not None:
        return model
    fam = _family(model)
    plan = _plan(model, fam)
    saved = []
    for m, fwd in plan:
        saved.append((m, m.__dict__.get("forward", _NONE)))
        if fwd is _mlp_forward:
            m._ember_proj = fam.mlp_proj
        m.forward = types.MethodType(fwd, m)
    setattr(model, _STATE, saved)
    return model


def unpatch(model):
    """Undo :func:`patch`: every swapped module gets back exactly the forward it had (the class's, or
    an instance forward set before patching). Unpatching an unpatched model does nothing.

    Example:
        >>> ember.train.unpatch(ember.train.patch(model)) is model
        True
    """
    saved = getattr(model, _STATE, None)
    if saved is None:
        return model
    for m, prev in saved:
        if prev is _NONE:
            del m.forward
        else:
            m.forward = prev
        m.__dict__.pop("_ember_proj", None)
    delattr(model, _STATE)
    return model


def is_patched(model) -> bool:
    """Whether :func:`patch` swapped ember's ops into ``model``."""
    return getattr(model, _STATE, None) is not None
