"""twinkle-mem in ms-swift: its GRPO log-probs and GKD loss from the LM head's input, its other log-probs on the op.

A user switches it on with ms-swift's own hook, nothing in their code: ``--external_plugins`` with twinkle-mem's
plugin file (:data:`PLUGIN`; ``python -m twinkle_mem`` prints its path), which ms-swift imports in every process that
parses arguments; or ``TWINKLE_MEM_SWIFT=1`` (or install()'s arguments), which twinkle-mem's start-up hook acts on
at ``import swift`` in every process. Either runs :func:`install` before any trainer exists.

What it patches (``patches.py``), each part recognized by ms-swift's code (``swift_names.py``) and refused by name
where it is not what twinkle-mem expects:

- ``grpo_fused_head``: GRPO's log-probs and entropy from the LM head's input (``grpo_head.py``);
- ``megatron_fused_head``: Megatron-SWIFT's GRPO log-probs and entropy from the output layer's input, over the TP
  group (``megatron_head.py``);
- ``gkd_fused_head``: GKD's loss from the student's LM head input, full and top-k teacher (``gkd_head.py``);
- ``logits_path``: TRL's ``selective_log_softmax`` / ``entropy_from_logits`` where ms-swift binds them (DPO, GRPO under
  sequence parallelism) on twinkle-mem's op; ``megatron_logits_path``: Megatron-SWIFT's log-probs on the op over
  the TP group (``logits_path.py``).

This module declares ms-swift (``FRAMEWORK``, ``core/framework.py``); it, ``swift_names``, ``patches``, ``settings``,
``startup`` and ``plugin`` import no torch at module level.
"""
from ..core.framework import Framework
from . import patches, startup, swift_names
from .startup import PLUGIN

__all__ = ["install", "uninstall", "is_installed", "installed_settings", "refused", "describe", "PLUGIN",
           "SwiftPartsNotRecognized"]

FRAMEWORK = Framework("ms-swift", package="swift", distribution="ms-swift", version_file="swift/version.py",
                      module=__name__, names=swift_names, patches=patches, startup=startup)
SwiftPartsNotRecognized = FRAMEWORK.refused_warning  # install()'s warning: parts of ms-swift left as shipped

install, uninstall, is_installed, installed_settings, refused, describe = FRAMEWORK.public_functions(
    """Put twinkle-mem into the ms-swift this process imports; idempotent, undone by :func:`uninstall`.

    Its keyword arguments are the settings of ``settings.py`` (the signature is built from them): ``fused_lm_head``:
    GRPO's log-probs (Megatron-SWIFT's too) and GKD's loss from the LM head's input; ``logits_path``: the log-prob functions ms-swift calls
    on the logits (DPO, GRPO under sequence parallelism, Megatron-SWIFT) on twinkle-mem's op; ``fused_chunk_bytes``:
    the fused heads' block working memory (256 MiB by default). A part of ms-swift not recognized is left as shipped,
    with a :class:`SwiftPartsNotRecognized` warning.""")
