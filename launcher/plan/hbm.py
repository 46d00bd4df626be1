"""A GPU's memory bandwidth, from datasheets: by product name where one architecture ships with
different memory, else by compute capability; a MIG slice gets its GPU instance's share. `cost`
prices memory-bound work and the optimizer step against it, `expected` the doctor's copy rate.

Pure arithmetic: no torch, no I/O; never imports cli, backends, jobs, runtime, results or report.
"""

from __future__ import annotations

import re

from launcher.hardware.types import DeviceSpec

# By product name where one architecture ships with different memory
# (A100 40GB HBM2 1555 GB/s vs 80GB HBM2e 2039; H100 PCIe 2000, NVL 3900, the 94/96 GB HBM2e
# H100 2410 (measured 2.41 TB/s, arXiv 2604.11391) vs SXM5 80GB HBM3 3350; H200 and H200 NVL
# 141 GB HBM3e 4800 (H200 datasheet); GH200 96 GB HBM3 4000, 144 GB HBM3e 4900 (GH200
# datasheet); GB200 186 GB HBM3e 8000 (GB200 NVL72 spec table), HGX B200 180 GB HBM3e 7700
# (HGX spec table: 62 TB/s per 8 GPUs; 8 TB/s in the first datasheet)), else by compute
# capability: V100 900, T4 320, A100 2039, A10/RTX 3090-class 936, L40S 864, H100 SXM5 3350,
# B200 7700, RTX 5090 / RTX PRO 6000 Blackwell 32 GB GDDR7 1792 (RTX Blackwell whitepaper).
HBM_GB_S_BY_NAME = (("a100-sxm4-40gb", 1555), ("a100-pcie-40gb", 1555), ("h100 pcie", 2000),
                    ("h100 nvl", 3900), ("hbm2e", 2410), ("gh200 144g", 4900), ("gh200", 4000),
                    ("h200", 4800), ("gb200", 8000), ("b200", 7700))
HBM_GB_S = {(7, 0): 900, (7, 5): 320, (8, 0): 2039, (8, 6): 936, (8, 9): 864, (9, 0): 3350,
            (10, 0): 7700, (12, 0): 1792}
HBM_GB_S_DEFAULT = 2000
_MIG_INSTANCE = re.compile(r"\bmig (?:\d+c\.)?(\d+)g\b")  # lower-cased names


def hbm_bytes_per_s(device: DeviceSpec) -> float:
    """The device's memory bandwidth (datasheets: see HBM_GB_S_BY_NAME and HBM_GB_S)."""
    name = device.name.lower()
    # a MIG slice ("... MIG 1g.10gb", "... MIG 2g slice") has its GPU instance's share of the
    # memory controllers: about its compute slices over the 7 a GPU has (1g: 1 of 8 memory
    # slices, 3g and 4g: 4 of 8; MIG user guide)
    mig = _MIG_INSTANCE.search(name)
    share = min(1.0, int(mig.group(1)) / 7) if mig else 1.0
    gb_s = next((listed for needle, listed in HBM_GB_S_BY_NAME if needle in name),
                HBM_GB_S.get(device.compute_capability or (0, 0), HBM_GB_S_DEFAULT))
    return gb_s * 1e9 * share
