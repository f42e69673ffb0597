"""Golden files: every released on-disk format version keeps decoding to the same values.

``tests/golden/ecf8_v1`` was written by ``compress encode ecf8 --slice-size 16`` from the tiny
synthetic checkpoint of ``tests/integration/test_hostile.py::tiny`` (seeded, regenerated here).
"""

import sys
from pathlib import Path

import numpy as np

from compress.checkpoint import Checkpoint
from compress.eval.verify import verify_checkpoint
from compress.formats.ecf8 import EncodedCheckpoint

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def test_ecf8_v1_golden_decodes_bit_exact(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
    from test_hostile import tiny

    original = Checkpoint.open(tiny(tmp_path / "src"))
    encoded = EncodedCheckpoint.open(GOLDEN / "ecf8_v1")
    assert {r["codec"] for r in encoded.records.values()} == {"ecf8", "raw"}
    for backend in ("cpu", "torch"):
        for name in original.names():
            _, want = original.read_array(name)
            _, got = encoded.read_array(name, backend=backend)
            np.testing.assert_array_equal(got.reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8))
    report = verify_checkpoint(original, encoded)
    assert report.ok, report.mismatches
