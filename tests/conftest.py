"""Shared test setup: the device list and the per-dtype tolerances.

TWINKLE_MEM_TEST_DEVICES=cpu,cuda (or cpu,npu) runs every device-parametrized
test on each listed device; the default is the CPU alone.
"""
import os

import pytest
import torch

DEVICES = [d.strip() for d in os.environ.get("TWINKLE_MEM_TEST_DEVICES", "cpu").split(",") if d.strip()]


def pytest_generate_tests(metafunc):
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", DEVICES)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
