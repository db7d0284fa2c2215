"""Copies of the installed twinkle-kit with edits, for fresh interpreters that put the copy first on the path:
a twinkle-kit that changed a name install() patches, and **a twinkle-kit with this project's three fixes
merged** (proposed upstream as twinkle PR #283), built from twinkle-kit 0.5.1's source as that PR describes
them, written here:

1. ``selective_log_softmax``: a chunked fp32 autograd Function (chunks of rows by a byte budget, the softmax
   recomputed in backward; saved: the logits and the labels), not the per-row loop;
2. the attention-mask type defaulting to ``causal`` for a causal LM, and the dense ``[B, 1, S, S]`` mask
   skipped at collate time, before it is allocated, where the attention builds its own (NPU);
3. Megatron's ``forward_backward`` reporting logits only when asked (``return_logits`` or the loss's
   ``require_logits``), as ``TransformersModel.forward`` keeps them, and collecting report entries with
   ``.get(key) is not None``.
"""
import importlib.metadata
import importlib.util
import os
import shutil

FIXED_SELECTIVE_LOG_SOFTMAX = '''

_FIXED_CHUNK_BYTES = 64 << 20


def _fixed_selective_log_softmax_function():
    """The autograd Function of fix 1 (built on first use: this module imports no torch at import)."""
    global _FIXED_FUNCTION
    if _FIXED_FUNCTION is not None:
        return _FIXED_FUNCTION
    import torch

    def chunks(logits):
        rows = max(1, _FIXED_CHUNK_BYTES // (4 * logits.shape[-1]))
        return range(0, logits.shape[0], rows), rows

    class SelectiveLogSoftmax(torch.autograd.Function):

        @staticmethod
        def forward(ctx, logits, index, return_entropy):
            flat, labels = logits.reshape(-1, logits.shape[-1]), index.reshape(-1)
            logps = torch.empty(labels.shape, dtype=torch.float32, device=logits.device)
            entropy = torch.empty_like(logps) if return_entropy else None
            starts, rows = chunks(flat)
            for s in starts:
                x = flat[s:s + rows].float()
                lse = torch.logsumexp(x, dim=-1)
                logps[s:s + rows] = x.gather(-1, labels[s:s + rows, None]).squeeze(-1) - lse
                if return_entropy:
                    entropy[s:s + rows] = lse - (torch.softmax(x, dim=-1) * x).sum(-1)
            ctx.save_for_backward(logits, index)
            ctx.return_entropy = return_entropy
            out_logps = logps.view(index.shape)
            return (out_logps, entropy.view(index.shape)) if return_entropy else out_logps

        @staticmethod
        def backward(ctx, grad_logps, grad_entropy=None):
            logits, index = ctx.saved_tensors
            flat, labels = logits.reshape(-1, logits.shape[-1]), index.reshape(-1)
            g_logp = grad_logps.reshape(-1).float()
            g_ent = grad_entropy.reshape(-1).float() if ctx.return_entropy and grad_entropy is not None else None
            grad = torch.empty_like(flat)
            starts, rows = chunks(flat)
            for s in starts:
                x = flat[s:s + rows].float()
                log_p = torch.log_softmax(x, dim=-1)
                p = log_p.exp()
                d = -p * g_logp[s:s + rows, None]
                d.scatter_add_(-1, labels[s:s + rows, None], g_logp[s:s + rows, None])
                if g_ent is not None:  # dH/dx = -p (log p + H)
                    entropy = -(p * log_p).sum(-1, keepdim=True)
                    d -= g_ent[s:s + rows, None] * p * (log_p + entropy)
                grad[s:s + rows] = d.to(grad.dtype)
            return grad.view(logits.shape), None, None

    _FIXED_FUNCTION = SelectiveLogSoftmax
    return _FIXED_FUNCTION


_FIXED_FUNCTION = None
'''

FIXED_TWINKLE_EDITS = (
    # 1. selective_log_softmax: the chunked fp32 Function where twinkle's per-row loops were
    ("utils/torch_utils.py", "    if logits.dtype in [torch.float32, torch.float64]:\n",
     "    return _fixed_selective_log_softmax_function().apply(logits, index, return_entropy)\n"
     "    if logits.dtype in [torch.float32, torch.float64]:\n"),
    ("utils/torch_utils.py", "\n\ndef _vocab_parallel_selective_log_softmax(",
     FIXED_SELECTIVE_LOG_SOFTMAX + "\n\ndef _vocab_parallel_selective_log_softmax("),
    # 2. the mask type defaults to causal; the dense mask is skipped at collate time where the attention builds its own
    ("processor/base.py", "        for pipe in self.process_pipeline:\n            inputs = pipe(inputs, **kwargs)\n",
     "        if kwargs.get('attention_mask_type') is None and \\\n"
     "                kwargs.get('task', 'causal_lm') in (None, 'causal_lm'):\n"
     "            kwargs['attention_mask_type'] = 'causal'\n"
     "        self._skip_dense_causal_mask = (kwargs.get('attention_mask_type') == 'causal'\n"
     "                                        and Platform.device_prefix() == 'npu')\n"
     "        for pipe in self.process_pipeline:\n            inputs = pipe(inputs, **kwargs)\n"),
    ("processor/base.py", "                if self.framework == 'megatron' and key == 'attention_mask':\n",
     "                if self.framework == 'megatron' and key == 'attention_mask' and \\\n"
     "                        getattr(self, '_skip_dense_causal_mask', False):\n"
     "                    continue  # the attention builds its own causal mask: none allocated\n"
     "                if self.framework == 'megatron' and key == 'attention_mask':\n"),
    # 3. Megatron's forward step reports logits only when asked; report entries collected when not None
    ("model/megatron/megatron.py",
     "            return self.strategy.reduce_loss(losses, counts, output_tensor, logps)\n",
     "            keep_logits = return_logits or getattr(loss_instance, 'require_logits', False)\n"
     "            return self.strategy.reduce_loss(losses, counts, output_tensor if keep_logits else None, logps)\n"),
    ("model/megatron/megatron.py", "                    if 'logits' in loss_dict:\n",
     "                    if loss_dict.get('logits') is not None:\n"),
    ("model/megatron/megatron.py", "                    if 'logps' in loss_dict:\n",
     "                    if loss_dict.get('logps') is not None:\n"),
)


def installed_twinkle() -> str:
    """The folder of the twinkle package this environment imports."""
    return list(importlib.util.find_spec("twinkle").submodule_search_locations)[0]


def twinkle_kit(version: str):
    """The folder of a twinkle package of that release found on the path (the environment's own under another
    release put first on PYTHONPATH), or None."""
    for dist in importlib.metadata.distributions(name="twinkle-kit"):
        folder = dist.locate_file("twinkle")
        if dist.version == version and os.path.isfile(os.path.join(folder, "__init__.py")):
            return str(folder)
    return None


def twinkle_copy(dest: str, edits, source=None) -> str:
    """The twinkle package at ``source`` (default: the one this environment imports) copied into ``dest`` (put
    ``dest`` first on PYTHONPATH), each edit ``(path below twinkle/, old text, new text)`` applied once; returns
    ``dest``."""
    shutil.copytree(source or installed_twinkle(), os.path.join(dest, "twinkle"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    for path, old, new in edits:
        file = os.path.join(dest, "twinkle", path)
        with open(file, encoding="utf-8") as f:
            text = f.read()
        assert text.count(old) == 1, f"{path}: the text to replace is not there once: {old!r}"
        with open(file, "w", encoding="utf-8") as f:
            f.write(text.replace(old, new))
    return dest
