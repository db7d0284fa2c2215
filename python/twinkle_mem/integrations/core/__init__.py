"""The integrations' shared core: what twinkle-kit's (``integrations/twinkle/``) and verl's
(``integrations/verl/``) integrations do alike, declared once.

- ``settings.py``: each setting declared once (name, default, parser, check, doc); the settings both share.
- ``source.py``: a framework's source read without importing it.
- ``recognition.py``: names, features and parts; a framework recognized by its code, refused part by part.
- ``install_plan.py``: install()'s plan: its settings and the parts patched, refused, described.
- ``patching.py``: patch points, each declared once with real references; each module patched on import.
- ``startup.py``: an integration's environment variable (grammar, checks, install at start-up, log line).
- ``framework.py``: ``Framework``, a framework declared once (its package, distribution, names table, settings,
  patches, variable and start-up hook), and what every integration does with it: find and recognize the framework,
  install / uninstall, the install at start-up, what ``python -m twinkle_mem`` says.

Nothing here imports torch or a framework: the start-up hooks run at ``import twinkle`` / ``import verl``.
"""
