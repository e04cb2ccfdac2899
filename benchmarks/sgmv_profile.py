"""One fused SGMV add-on per configuration, for Nsight Compute (device only):

    ncu --clock-control none --section SpeedOfLight --section LaunchStats --section Occupancy \\
        --section WarpStateStats --section SchedulerStats -k regex:sgmv python benchmarks/sgmv_profile.py

Each configuration runs twice (the first compiles and warms up); ncu flushes the caches
before each profiled launch, as benchmarks/sgmv.py does before each timed one.
"""

import numpy as np
import torch

from benchmarks.sgmv import Case, random_pool

CONFIGS = [(16, 16), (64, 16)]  # (rank, batch), Distinct workload


def main():
    rng = np.random.default_rng(0)
    for rank, batch in CONFIGS:
        pool = random_pool(rank)
        case = Case(rank, "distinct", batch, rng, pool)
        for _ in range(2):
            case.ours()
            torch.cuda.synchronize()


if __name__ == "__main__":
    main()
