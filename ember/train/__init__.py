"""Training with ember's ops inside a transformers model: ``ember.train.patch(model)`` swaps in the
fused norms, SwiGLU, the MoE experts with backward and the logits-free causal-LM loss;
``ember.train.unpatch(model)`` puts transformers' forwards back.

Example:
    >>> model = ember.train.patch(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16))
    >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    >>> for batch in loader:
    ...     model(**batch, labels=batch["input_ids"]).loss.backward(); opt.step(); opt.zero_grad()
"""
from ember.train.patch import FAMILIES, causal_lm_loss, is_patched, patch, unpatch

__all__ = ["FAMILIES", "causal_lm_loss", "is_patched", "patch", "unpatch"]
