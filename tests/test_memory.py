"""specdecode.models.memory: pages a process no longer reads go back to the system."""

import re
import sys

import pytest
import torch

from specdecode.models import memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")


def file_resident_mib() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"RssFile:\s+(\d+)", f.read()).group(1)) // 1024


def test_a_mapped_files_pages_go_back_and_read_the_same_again(tmp_path):
    path = tmp_path / "weights.bin"
    data = torch.arange(32 * 2**20 // 4, dtype=torch.float32)  # 32 MiB
    path.write_bytes(data.numpy().tobytes())
    mapped = torch.from_file(str(path), shared=False, size=data.numel(), dtype=torch.float32)
    assert float(mapped.sum()) == float(data.sum())  # every page read: resident
    before = file_resident_mib()
    assert memory.drop_file_pages(mapped) >= 31 * 2**20
    assert before - file_resident_mib() >= 28
    assert torch.equal(mapped, data)  # a file's pages are read again where touched: nothing lost


def test_memory_that_no_file_backs_is_left_alone():
    heap = torch.ones(8 * 2**20)
    assert memory.drop_file_pages(heap) == 0
    assert bool((heap == 1).all())
