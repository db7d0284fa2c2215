"""twinkle-mem's ``verl.plugins`` entry point: ``import verl`` imports this module in every process (the driver and
each Ray worker, verl 0.9.0 on), which installs twinkle-mem there before any engine is built, as
``TWINKLE_MEM_VERL`` asks (``startup.py``)."""
from . import FRAMEWORK

FRAMEWORK.install_from_environment()
