"""Run every benchmark in turn (`make bench`); `--quick` is passed through. The heavy Llama-layer
benchmark runs last, alone. Each script prints its table and writes benchmarks/results/<name>.json.
Then the GPU checks (gpu_check.sh) where a GPU is visible; where none is, one line says
they did not run."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ORDER = (
    "bench_seed.py",
    "bench_matrix.py",
    "bench_step.py",
    "bench_check.py",
    "bench_threads.py",
    "bench_stop.py",
    "bench_hf_sweep.py",
    "bench_llama_layer.py",
)


def main() -> int:
    extra = [a for a in sys.argv[1:] if a == "--quick"]
    skip = {a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--skip=")}
    failed = []
    for script in ORDER:
        if script.removeprefix("bench_").removesuffix(".py") in skip:
            continue
        print(f"\n=== {script} {' '.join(extra)}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call([sys.executable, str(HERE / script), *extra])
        print(f"=== {script}: exit {rc}, {time.perf_counter() - t0:.0f} s", flush=True)
        if rc:
            failed.append(script)
    if "gpu" not in skip:
        import torch

        # NVML: CUDA is not started here
        if torch.backends.cuda.is_built() and torch.cuda.device_count() > 0:
            print("\n=== gpu_check.sh", flush=True)
            if subprocess.call(["bash", str(HERE / "gpu_check.sh")]):
                failed.append("gpu_check.sh")
        else:
            print(
                "\nTARGET GPU path (benchmarks/gpu_check.sh): not run, no GPU visible -> UNTESTED"
            )
    if failed:
        print(f"failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
