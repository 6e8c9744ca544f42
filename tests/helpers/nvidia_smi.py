"""Readers of recorded `nvidia-smi` outputs in the default table and `-q` formats (tests/fixtures/nvidia-smi).

Hosts are read through `--query-gpu` CSV (module_utils/regen_gpu.gather); these two formats are what the
public recordings of other machines (B200, RTX PRO 6000, H200) hold, so the tests turn them into the same
GPU records with these readers. Test-only: nothing in the pipeline parses these formats.
"""

from __future__ import annotations

import re

# _gpu_record: the one shape of a GPU record, the one regen_gpu.parse_query_csv gives hosts.
from ansible.module_utils.regen_gpu import _gpu_record, parse_versions

TABLE_ROW = re.compile(r"^\|\s+(\d+)\s+(.+?)\s+(On|Off)\s+\|\s+([0-9A-Fa-f]+:[0-9A-Fa-f]+:[0-9A-Fa-f.]+)\s")
TABLE_MEM = re.compile(r"(\d+)MiB\s*/\s*(\d+)MiB")


def parse_table(text):
    """The default `nvidia-smi` summary table -> (gpus, driver, cuda)."""
    lines = text.splitlines()
    gpus = []
    for number, line in enumerate(lines):
        match = TABLE_ROW.match(line)
        if not match:
            continue
        memory = None
        if number + 1 < len(lines):
            found = TABLE_MEM.search(lines[number + 1])
            memory = found.group(2) if found else None
        gpus.append(
            _gpu_record(
                {
                    "index": match.group(1),
                    "name": match.group(2),
                    "pci.bus_id": match.group(4),
                    "memory.total": memory or "",
                }
            )
        )
    driver, cuda = parse_versions(text)
    for gpu in gpus:
        gpu["driver_version"] = driver
    return gpus, driver, cuda


def parse_query_details(text):
    """`nvidia-smi -q` -> (gpus, driver, cuda, attached count)."""
    driver, cuda = parse_versions(text)
    attached = re.search(r"Attached GPUs\s*:\s*(\d+)", text)
    gpus = []
    blocks = re.split(r"^GPU ([0-9A-Fa-f]+:[0-9A-Fa-f]+:[0-9A-Fa-f.]+)\s*$", text, flags=re.M)
    for at in range(1, len(blocks) - 1, 2):
        bus, body = blocks[at], blocks[at + 1]
        name = re.search(r"Product Name\s*:\s*(.+)", body)
        total = re.search(r"FB Memory Usage\s*\n\s*Total\s*:\s*(\d+)\s*MiB", body)
        minor = re.search(r"Minor Number\s*:\s*(\d+)", body)
        gpus.append(
            _gpu_record(
                {
                    "index": minor.group(1) if minor else "",
                    "name": name.group(1) if name else "",
                    "pci.bus_id": bus,
                    "memory.total": total.group(1) if total else "",
                    "driver_version": driver or "",
                }
            )
        )
    return gpus, driver, cuda, int(attached.group(1)) if attached else None
