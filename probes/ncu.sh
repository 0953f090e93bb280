set -x
nvidia-smi --query-gpu=name --format=csv
export PYTHONPATH=.
python3 - <<'P'
import cupy_rope, torch
P
for w in qwen wan; do
timeout 200 ncu --clock-control none -k regex:norm_rope_kernel --launch-skip 2 --launch-count 1 --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis python3 probes/ncu_probe.py $w 2>&1 | grep -v "^==PROF==" | grep -E "ok|Duration|Throughput|Registers|Occupancy|Block Limit|Stall|Warp Cycles|Grid Size|Block Size|Shared Memory Config|Dynamic|Static|Waves|L1/TEX Hit|L2 Hit|Mem Busy|Max Bandwidth|Issued|Eligible|norm_rope_kernel<" | cut -c1-200
timeout 200 ncu --clock-control none -k regex:norm_rope_kernel --launch-skip 5 --launch-count 1 --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats python3 probes/ncu_probe.py $w 2>&1 | grep -E "Duration|Throughput|Registers|Achieved Occupancy|Theoretical Occupancy|Block Limit|Grid Size|Block Size|Waves|Stall|Warp Cycles" | cut -c1-200
done
for w in decode-bf16 decode-fp8; do
timeout 100 ncu --clock-control none -k regex:rope_cache_kernel --launch-skip 3 --launch-count 1 --section SpeedOfLight --section LaunchStats --section WarpStateStats python3 probes/ncu_probe.py $w 2>&1 | grep -E "rope_cache_kernel<|Duration|Registers|Grid Size|Block Size|Warp Cycles|Stall" | cut -c1-250
done
