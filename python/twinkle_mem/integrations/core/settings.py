"""An integration's settings, each declared once: its name, default, parser (a variable's text to a value),
check (why a value is refused) and doc. From that one declaration come the install() signature, the settings
dict, a variable's grammar and its accepted-values text, and the checks of install() and of the variable alike.

No torch here: a framework's start-up hook reads its variable before the process has imported torch.
"""
import inspect
import re
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_SIZE = re.compile(r"(\d+)\s*(?:([kmg])(?:i?b)?|b)?", re.IGNORECASE)
_UNITS = {None: 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


class Parser(NamedTuple):
    """A variable's text for one setting (None: the name alone) to its value; raises ValueError with the end of
    a sentence that starts with the setting's name ("... is not a boolean")."""
    parse: Callable[[Optional[str]], Any]
    syntax: str  # how the accepted-values text writes it after the name; "" for a boolean (a bare name)


def _boolean(text: Optional[str]) -> bool:
    if text is None or text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise ValueError("is not a boolean")


def _size(text: Optional[str]) -> Optional[int]:
    if text is not None and text.lower() == "none":
        return None
    match = _SIZE.fullmatch(text or "")
    if match is None or int(match.group(1)) == 0:
        raise ValueError("must be a positive size in bytes (K/M/G suffixes for KiB/MiB/GiB) or none")
    return int(match.group(1)) * _UNITS[match.group(2) and match.group(2).lower()]


BOOLEAN = Parser(_boolean, "")
SIZE = Parser(_size, "=<bytes, with K/M/G for KiB/MiB/GiB>|none")


def choice(values: Tuple[str, ...]) -> Parser:
    """The text as given; the setting's check (:func:`one_of`) judges it, for install() as for the variable."""
    return Parser(lambda text: text, "=" + "|".join(values))


def one_of(values: Tuple[str, ...]) -> Callable[[str, Any], Optional[str]]:
    return lambda name, value: None if value in values else f"{name} must be one of {values}, got {value!r}"


class Setting(NamedTuple):
    name: str
    default: Any
    parser: Parser
    doc: str  # what it does (docs, describe())
    check: Callable[[str, Any], Optional[str]] = lambda name, value: None  # why (name, value) is refused, or None

    def of(self, values: Dict[str, Any]) -> Any:
        """This setting's value in a settings dict."""
        return values[self.name]


class Needs(NamedTuple):
    """A rule between two settings: ``setting`` set (true, or not None) needs ``needed`` true."""
    setting: Setting
    needed: Setting
    message: str

    def broken(self, values: Dict[str, Any]) -> bool:
        value = values.get(self.setting.name, self.setting.default)
        return value not in (None, False) and not values.get(self.needed.name, self.needed.default)


class Settings:
    """The settings of one install() function, in its keyword order, and the rules between them."""

    def __init__(self, *settings: Setting, rules: Tuple[Needs, ...] = ()):
        self.settings, self.rules = settings, rules
        self.by_name = {s.name: s for s in settings}

    def defaults(self) -> Dict[str, Any]:
        return {s.name: s.default for s in self.settings}

    def signature(self) -> inspect.Signature:
        """install()'s signature: every setting keyword-only, with its default."""
        return inspect.Signature([inspect.Parameter(s.name, inspect.Parameter.KEYWORD_ONLY, default=s.default)
                                  for s in self.settings])

    def bind(self, function: str, given: Dict[str, Any]) -> Dict[str, Any]:
        """Every setting's value: the defaults overridden by ``given``; TypeError for a name that is none."""
        unknown = sorted(set(given) - set(self.by_name))
        if unknown:
            raise TypeError(f"{function}() got an unexpected keyword argument {unknown[0]!r}")
        return {**self.defaults(), **given}

    def check(self, values: Dict[str, Any]) -> None:
        """Raise ValueError for a value or a combination of values that is refused (given ones only)."""
        for name, value in values.items():
            why = self.by_name[name].check(name, value)
            if why is not None:
                raise ValueError(why)
        for rule in self.rules:
            if rule.broken(values):
                raise ValueError(rule.message)

    def accepted(self, function: str) -> str:
        """The grammar of a variable holding these settings (the end of every message about a bad value)."""
        flags = [s.name for s in self.settings if not s.parser.syntax]
        others = [s.name + s.parser.syntax for s in self.settings if s.parser.syntax]
        listed = ([", ".join(flags) + " (a bare name is true; or =true/false, =1/0, =yes/no, =on/off)"]
                  if flags else []) + others
        return (f"accepted: '1' ({function}() with its defaults), '0' or empty (off), or a comma-separated list of "
                f"{function}()'s arguments: " + ", ".join(listed))


# --- settings every integration shares -----------------------------------------------------------------------

# The fused head's smallest block working memory: one row tile (512 rows) of a one-column vocab block, bf16, on the
# CPU's plan, below what any call of any plan needs (twinkle_mem.heads.plans.block_need; a test holds it so). A
# number here, not computed: the variables' checks run where the process must not import torch for them.
SMALLEST_CHUNK_BYTES = 1024


def _chunk_bytes_refused(name: str, value: Any) -> Optional[str]:
    if value is None:
        return None
    if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return f"{name} must be a positive int or None, got {value!r}"
    if value < SMALLEST_CHUNK_BYTES:
        return (f"{name}={value} is below one row tile of the narrowest vocab block the fused LM head ever uses "
                f"({SMALLEST_CHUNK_BYTES} bytes: no model fits); whether a value fits a model is judged at its first "
                "fused step; None is the default (the device's plan: 256 MiB on the CPU, 2 GiB on a GPU)")
    return None


FUSED_CHUNK_BYTES = Setting("fused_chunk_bytes", None, SIZE,
                            "the fused LM head's block working memory (its chunk_bytes; None: the device's plan, "
                            "256 MiB on the CPU, 2 GiB on a GPU)",
                            _chunk_bytes_refused)
