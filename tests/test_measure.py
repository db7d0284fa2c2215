"""The peak-RSS measurement the memory tests and benchmarks rely on must see
a large temporary, and must not see memory allocated before the block."""
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import torch
    from twinkle_mem.measure import peak_rss
    held = torch.ones(64 << 18)  # 64 MiB, touched before the block
    with peak_rss() as quiet:
        pass
    with peak_rss() as busy:
        tmp = torch.ones(64 << 18)  # 64 MiB temporary, touched, freed inside
        del tmp
    print(quiet.bytes, busy.bytes)
""")


def test_peak_rss_sees_temporaries_only():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True).stdout.split()
    quiet, busy = int(out[0]), int(out[1])
    assert quiet < 4 << 20, quiet
    assert 60 << 20 <= busy <= 72 << 20, busy
