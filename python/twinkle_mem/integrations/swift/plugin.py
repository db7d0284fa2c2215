"""twinkle-mem's ms-swift plugin: ``--external_plugins <this file>`` (``python -m twinkle_mem`` prints its path).
ms-swift imports it in every process that parses its arguments, before any trainer is built, and it installs
twinkle-mem there as ``TWINKLE_MEM_SWIFT`` asks (unset: install() with its defaults; ``0``: nothing)."""
from twinkle_mem.integrations.swift.startup import install_from_plugin

install_from_plugin()
