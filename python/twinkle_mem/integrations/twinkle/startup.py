"""``TWINKLE_MEM_INSTALL``: :func:`install` in every process that imports twinkle, from one variable.

This module owns the variable: its grammar (:func:`parse`), what it would do (:func:`describe`, for
``python -m twinkle_mem``), and the install run by the start-up hook (``twinkle_mem_startup.py``, put
in site-packages by ``pip install``) right after twinkle's package has been imported
(``FRAMEWORK.install_from_environment``, ``core/framework.py``), with its one log line.

Values: unset, empty or ``0``: off. ``1``: ``install()`` with its defaults. Otherwise a comma-separated
list of ``install()``'s keyword arguments, a bare name meaning ``True``:
``fused_lm_head,mask_skip=always,fused_chunk_bytes=128M``. A value that is none of these, or a part of
twinkle-kit that ``install()`` does not recognize (twinkle_names.py), makes ``import twinkle`` raise, so the
job fails at its start instead of training with twinkle-kit as shipped. ``import twinkle`` itself imports no
more than it did: install() patches each twinkle module when the process imports it (patches.py), and this
module and those it imports need no torch.
"""
import functools

from ..core.framework import StartupHook
from ..core.startup import Variable, import_hook_status
from .settings import SETTINGS

ENV_VAR = "TWINKLE_MEM_INSTALL"

VARIABLE = Variable(ENV_VAR, SETTINGS, framework="twinkle-kit", package="twinkle", logger="twinkle_mem.startup",
                    example="fused_lm_head,mask_skip=always,fused_chunk_bytes=128M")
ACCEPTED = VARIABLE.accepted
# One parser per install() keyword argument (a test holds this to install()'s signature).
OPTIONS = {setting.name: setting.parser.parse for setting in SETTINGS.settings}
parse, install_call, describe = VARIABLE.parse, VARIABLE.install_call, VARIABLE.describe

# A part of twinkle-kit not recognized makes the variable's install raise (an explicit install() would leave it as
# shipped): the job fails at its start instead of training with twinkle-kit as shipped.
HOOK = StartupHook("start-up hook", functools.partial(import_hook_status, ENV_VAR), strict=True,
                   advice=f"To run twinkle-kit as shipped, unset {ENV_VAR} (or set it to 0); install() called in the "
                          "script patches the parts it recognizes and leaves the others as shipped.")
