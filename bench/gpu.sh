#!/usr/bin/env bash
# dplit on one CUDA GPU, time-boxed to under 10 minutes on one H100/H200, offline:
#   tests          python -m pytest -m gpu: bf16-mixed ghost clipping vs the fp32 reference on CUDA, DPStrategy on
#                  one GPU with NCCL, CUDA peak-memory logging                                        (90 s)
#   bench_gpt2     bench.run, GPT-2 size, B=16, T=128, bf16-mixed: non-private tied/untied, dplit ghost
#                  tied/untied, dplit per-example tied, opacus ghost untied                            (80 s)
#   bench_smollm2  the same rows at SmolLM2-135M's shape, B=16, T=64                                  (100 s)
#   tying          bench.tying, one seed at ε = 8 on real SST-2 with SmolLM2-135M-Instruct (GGUF from
#                  $DPLIT_DATA_DIR): the DP tied and DP untied arms; 4096 train rows, B=512, 1 epoch  (170 s)
#   fsdp_smoke     bench.fsdp at SmolLM2-135M's shape on CUDA with NCCL, B=8, T=64: sharded DP-SGD (FSDP2),
#                  DP-SGD on whole replicas, non-private FSDP, at world size 1; with 2+ GPUs also world
#                  size 2 (into fsdp_smoke/world2/)                                                    (40 s)
#   memory_smoke   bench.memory at SmolLM2-135M's shape on CUDA, B=8, T=512, bf16 autocast, bf16 4-bit compute:
#                  DP and non-private LoRA and QLoRA (NF4), each with and without checkpointing      (40 s)
#   packing        bench.packing, GPT-2 size and SmolLM2-135M's shape, rows of 512 and 1024 tokens, 128 documents:
#                  packed vs padded DP tokens/s (ghost) and the packed non-private step, on SST-2 sentences and a
#                  log-normal mix (issue 54); its table is rewritten after each row (a timeout keeps those)  (60 s)
# Each part runs under `timeout` with its own budget, capped by what is left of DPLIT_GPU_TOTAL_S (585 s).
# Writes bench/results/gpu/ (or $DPLIT_GPU_OUT): summary.md and summary.json (each part's status, exit code,
# wall time and budget, the machine: nvidia-smi, torch, CUDA), machine.json, each part's console log
# (<part>.log) and results folder (bench_gpt2/, bench_smollm2/, tying/, fsdp_smoke/, memory_smoke/, packing/). Bulky
# scratch (Lightning logs, the dequantised checkpoint) goes to bench/out/gpu/ (git-ignored; $DPLIT_GPU_WORK).
# Without CUDA every part is skipped with the reason in the summary, in a few seconds, exit 0; such a run never
# replaces the summary of an earlier GPU run in the default folder (it writes bench/out/gpu/cpu-check/).
#
# Run:  bash bench/gpu.sh                (from the repository root; exit 0 when no part failed or timed out)
# Each part runs in the repository root, as `python -m bench.<name>` or `python -m pytest`.
# Env:  PYTHON (python), DPLIT_DATA_DIR (default ../shared/data, else shared/data), DPLIT_GPU_OUT, DPLIT_GPU_WORK,
#       DPLIT_GPU_TOTAL_S, DPLIT_GPU_BUDGET_TESTS / _GPT2 / _SMOLLM2 / _TYING / _FSDP / _MEMORY / _PACKING (s per part)
set -uo pipefail

CALLER_DIR=$PWD
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

START=$(date +%s)
START_ISO=$(date -Iseconds)
TOTAL=${DPLIT_GPU_TOTAL_S:-585}
GRACE=10  # seconds a part gets after SIGTERM before SIGKILL (counted inside the total)
declare -A BUDGET=(
  [tests]=${DPLIT_GPU_BUDGET_TESTS:-90}
  [bench_gpt2]=${DPLIT_GPU_BUDGET_GPT2:-80}
  [bench_smollm2]=${DPLIT_GPU_BUDGET_SMOLLM2:-100}
  [tying]=${DPLIT_GPU_BUDGET_TYING:-170}
  [fsdp_smoke]=${DPLIT_GPU_BUDGET_FSDP:-40}
  [memory_smoke]=${DPLIT_GPU_BUDGET_MEMORY:-40}
  [packing]=${DPLIT_GPU_BUDGET_PACKING:-60}
)
BENCH_CONFIGS=(non_private:untied non_private:tied dplit_ghost:untied dplit_ghost:tied dplit_per_example:tied
               opacus_ghost:untied)
GGUF=smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf

absolute() {  # a path given relative to the caller's directory, made absolute
  case $1 in /*) printf '%s\n' "$1" ;; *) printf '%s\n' "$CALLER_DIR/$1" ;; esac
}

PYTHON=${PYTHON:-python}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
WORK=$(absolute "${DPLIT_GPU_WORK:-$ROOT/bench/out/gpu}")
DEFAULT_OUT=$ROOT/bench/results/gpu
OUT=$(absolute "${DPLIT_GPU_OUT:-$DEFAULT_OUT}")
if [[ -n ${DPLIT_DATA_DIR:-} ]]; then
  DATA=$(absolute "$DPLIT_DATA_DIR")
else  # beside the checkout (../shared/data), else inside it (shared/data)
  DATA=$(cd "$ROOT/.." && pwd)/shared/data
  [[ ! -d $DATA && -d $ROOT/shared/data ]] && DATA=$ROOT/shared/data
fi
mkdir -p "$WORK" || exit 2

# ---------------------------------------------------------------------------------------------------------------
# The machine: nvidia-smi when present, torch and CUDA as torch sees them

probe_machine() {  # writes $1 (JSON); prints "cuda=1" or "cuda=0" last
  local smi=""
  if command -v nvidia-smi >/dev/null 2>&1; then
    smi=$(timeout 30 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -8)
  fi
  NVIDIA_SMI=$smi timeout 90 "$PYTHON" - "$1" <<'EOF'
import importlib.metadata, json, os, platform, subprocess, sys

def version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None

info = {"python": platform.python_version(), "executable": sys.executable, "platform": platform.platform(),
        "logical_cpus": len(os.sched_getaffinity(0)), "nvidia_smi": os.environ.get("NVIDIA_SMI") or None}
info.update({name: version(name) for name in ("lightning", "transformers", "opacus", "gguf", "matplotlib")})
with open("/proc/cpuinfo") as cpuinfo:
    info["cpu_model"] = next((l.split(":", 1)[1].strip() for l in cpuinfo if l.startswith("model name")), None)
git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True).stdout.rstrip("\n")
info["git_head"] = git("rev-parse", "--short", "HEAD")
info["git_uncommitted"] = git("status", "--porcelain", "--", "dplit", "bench", "tests", "configs").splitlines()
try:
    import torch
except Exception as error:  # noqa: BLE001
    info.update({"torch": None, "cuda_available": False, "cuda_reason": f"torch does not import: {error}"})
else:
    cuda = torch.cuda.is_available()
    info.update({"torch": torch.__version__, "torch_cuda_build": torch.version.cuda, "cuda_available": cuda,
                 "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")})
    if cuda:
        info.update({"cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                     "cuda_capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
                     "bf16_supported": torch.cuda.is_bf16_supported(),
                     "nccl_available": torch.distributed.is_available() and torch.distributed.is_nccl_available()})
    else:
        built = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a build without CUDA"
        info["cuda_reason"] = (f"CUDA is not available: torch.cuda.is_available() is False (torch {torch.__version__}, "
                               f"{built}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
with open(sys.argv[1], "w") as out:
    json.dump(info, out, indent=1)
print("cuda=1" if info["cuda_available"] else "cuda=0")
EOF
}

PROBE=$WORK/machine.probe.json
rm -f "$PROBE"
PROBE_OUTPUT=$(probe_machine "$PROBE" 2>&1)
PROBE_CODE=$?
CUDA=0
[[ $PROBE_OUTPUT == *cuda=1 ]] && CUDA=1
if [[ ! -s $PROBE ]]; then  # the probe itself failed (no python, a hang): record why, skip everything
  printf '{"cuda_available": false, "cuda_reason": "the machine probe failed (exit %s): %s"}\n' "$PROBE_CODE" \
    "$(printf '%s' "$PROBE_OUTPUT" | tail -1 | tr -d '"\\' | cut -c1-300)" >"$PROBE"
fi
NO_CUDA_REASON=$("$PYTHON" -c 'import json,sys; print(json.load(open(sys.argv[1])).get("cuda_reason") or "")' \
  "$PROBE" 2>/dev/null || echo "CUDA is not available (the machine probe failed)")

# A CPU run must not replace an earlier GPU run's results in the default (committed) folder.
if (( ! CUDA )) && [[ -z ${DPLIT_GPU_OUT:-} && -f $OUT/summary.json ]] \
    && grep -q '"cuda_available": true' "$OUT/summary.json"; then
  echo "no CUDA here and $OUT holds a GPU run's results: writing this run's summary to $WORK/cpu-check instead"
  OUT=$WORK/cpu-check
fi
mkdir -p "$OUT" || exit 2
for name in summary.json summary.md machine.json nvidia-smi.txt parts.tsv tests.log tests.junit.xml \
            bench_gpt2.log bench_smollm2.log tying.log fsdp_smoke.log memory_smoke.log packing.log; do
  rm -f -- "${OUT:?}/$name"
done
rm -rf -- "${OUT:?}/bench_gpt2" "${OUT:?}/bench_smollm2" "${OUT:?}/tying" "${OUT:?}/fsdp_smoke" \
          "${OUT:?}/memory_smoke" "${OUT:?}/packing"
mv "$PROBE" "$OUT/machine.json"
command -v nvidia-smi >/dev/null 2>&1 && timeout 30 nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1

# ---------------------------------------------------------------------------------------------------------------
# Parts and the summary

PARTS=$OUT/parts.tsv
: >"$PARTS"
RUNNING=""  # the pid of the part's `timeout` while one runs

on_signal() {  # stopped from outside: stop the running part (timeout signals its process group), keep a summary
  trap - INT TERM HUP
  if [[ -n $RUNNING ]]; then
    kill -TERM "$RUNNING" 2>/dev/null
    wait "$RUNNING" 2>/dev/null
  fi
  write_summary false
  echo "dplit gpu.sh: stopped by a signal; partial summary in $OUT/summary.md" >&2
  exit 130
}
trap on_signal INT TERM HUP

record() {  # name status exit_code wall_s budget_s log reason command...
  local name=$1 status=$2 code=$3 wall=$4 budget=$5 log=$6 reason=$7
  shift 7
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$code" "$wall" "$budget" "$log" \
    "${reason//$'\t'/ }" "$*" >>"$PARTS"
  write_summary false
}

skip() {  # name reason command...: recorded with the command it would have run
  local name=$1 reason=$2
  shift 2
  record "$name" skipped "" 0 "${BUDGET[$name]}" "" "$reason" "$*"
  echo "[$name] skipped: $reason"
}

run_part() {  # name command...: run under timeout with the part's budget (capped by the time left)
  local name=$1
  shift
  local budget=${BUDGET[$name]} left=$(( START + TOTAL - $(date +%s) - GRACE ))
  if (( left < 20 )); then
    skip "$name" "no time left in the ${TOTAL} s budget of the whole script" "$@"
    return
  fi
  (( budget > left )) && budget=$left
  local log=$OUT/$name.log began ended code status
  echo "[$name] up to ${budget} s: $*"
  began=$(date +%s.%N)
  # in the background, so that a signal to this script reaches the part at once (see on_signal)
  timeout --signal=TERM --kill-after="$GRACE" "$budget" "$@" </dev/null >"$log" 2>&1 &
  RUNNING=$!
  wait "$RUNNING"
  code=$?
  RUNNING=""
  ended=$(date +%s.%N)
  case $code in
    0) status=ok ;;
    124 | 137) status="timed out" ;;
    *) status=failed ;;
  esac
  record "$name" "$status" "$code" "$(awk -v a="$began" -v b="$ended" 'BEGIN { printf "%.1f", b - a }')" "$budget" \
    "${log#"$OUT"/}" "" "$*"
  echo "[$name] $status (exit $code)"
}

write_summary() {  # complete (true/false): summary.json and summary.md from parts.tsv and machine.json
  SUMMARY_COMPLETE=$1 SUMMARY_OUT=$OUT SUMMARY_START=$START SUMMARY_START_ISO=$START_ISO SUMMARY_TOTAL=$TOTAL \
  SUMMARY_DATA=$DATA SUMMARY_CUDA=$CUDA SUMMARY_ROOT=$ROOT "$PYTHON" - <<'EOF' || echo "warning: no summary written" >&2
import json, os, time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

out = Path(os.environ["SUMMARY_OUT"])
machine = json.loads((out / "machine.json").read_text()) if (out / "machine.json").is_file() else {}
fields = ("name", "status", "exit_code", "wall_s", "budget_s", "log", "reason", "command")
parts = []
for line in (out / "parts.tsv").read_text().splitlines():
    part = dict(zip(fields, line.split("\t")))
    part["exit_code"] = int(part["exit_code"]) if part["exit_code"] else None
    part["wall_s"], part["budget_s"] = float(part["wall_s"]), float(part["budget_s"])
    part["log"], part["reason"] = part["log"] or None, part["reason"] or None
    part["command"] = part["command"].replace(os.environ["SUMMARY_ROOT"] + "/", "") or None  # paths in the checkout
    folder = out / part["name"]
    pages = [*folder.glob("*.md"), *folder.glob("world*/*.md")] if folder.is_dir() else []  # fsdp_smoke/world2/
    part["results"] = sorted(str(p.relative_to(out)) for p in pages)
    parts.append(part)
    junit = out / "tests.junit.xml"
    if part["name"] == "tests" and junit.is_file():
        try:
            suite = ElementTree.parse(junit).getroot()
            suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
            part["tests"] = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
            part["results"] = ["tests.junit.xml"]
        except (ElementTree.ParseError, AttributeError, ValueError):
            pass
bad = [p for p in parts if p["status"] in ("failed", "timed out")]
summary = {
    "created": os.environ["SUMMARY_START_ISO"], "complete": os.environ["SUMMARY_COMPLETE"] == "true",
    "exit_code": 1 if bad else 0, "wall_s": round(time.time() - int(os.environ["SUMMARY_START"]), 1),
    "budget_s": int(os.environ["SUMMARY_TOTAL"]), "cuda_available": os.environ["SUMMARY_CUDA"] == "1",
    "data_dir": os.environ["SUMMARY_DATA"], "data_found": Path(os.environ["SUMMARY_DATA"]).is_dir(),
    "machine": machine, "parts": parts,
}
(out / "summary.json").write_text(json.dumps(summary, indent=1, allow_nan=False) + "\n")

gpu = machine.get("nvidia_smi") or ", ".join(machine.get("cuda_devices") or []) or "none visible"
lines = [
    "# dplit on a GPU: bench/gpu.sh", "",
    f"Run {summary['created']}, {summary['wall_s']:.0f} s of the {summary['budget_s']} s budget"
    + ("" if summary["complete"] else " (incomplete: the script was still running or was stopped)")
    + f"; exit code {summary['exit_code']}.", "",
    f"Machine: GPU: {gpu}; CPU {machine.get('cpu_model')} ({machine.get('logical_cpus')} logical CPUs); "
    f"torch {machine.get('torch')} (CUDA build {machine.get('torch_cuda_build')}), "
    f"lightning {machine.get('lightning')}, "
    f"transformers {machine.get('transformers')}, opacus {machine.get('opacus')}, Python {machine.get('python')}; "
    f"dplit at {machine.get('git_head')}" + (" + uncommitted changes" if machine.get("git_uncommitted") else "") + ".",
    "",
]
if not summary["cuda_available"]:
    lines += [f"**No CUDA**: {machine.get('cuda_reason')}. Every part below is skipped.", ""]
lines += ["| part | status | exit code | wall s | budget s | results / reason |", "|---|---|---:|---:|---:|---|"]
for p in parts:
    note = p["reason"] or ", ".join(f"[{r}]({r})" for r in p["results"]) or (f"log: {p['log']}" if p["log"] else "")
    if p.get("tests"):
        t = p["tests"]
        note = f"{t['tests']} tests, {t['failures']} failed, {t['errors']} errors, {t['skipped']} skipped; " + note
    code = "" if p["exit_code"] is None else p["exit_code"]
    lines.append(f"| {p['name']} | {p['status']} | {code} | {p['wall_s']:.0f} | {p['budget_s']:.0f} | {note} |")
lines += ["", "Commands (each under `timeout` with its budget; a skipped part's is what it would have run):", ""]
lines += [f"* {p['name']}" + (" (skipped)" if p["status"] == "skipped" else "") + f": `{p['command']}`"
          for p in parts if p["command"]]
for p in bad:
    log = out / p["log"] if p["log"] else None
    tail = log.read_text(errors="replace").splitlines()[-25:] if log and log.is_file() else []
    lines += ["", f"## {p['name']}: {p['status']} (exit {p['exit_code']}), end of {p['log']}", "", "```", *tail, "```"]
(out / "summary.md").write_text("\n".join(lines) + "\n")
EOF
}

# ---------------------------------------------------------------------------------------------------------------
# The parts

tying_problem() {  # prints why the tying slice cannot run here (empty when it can)
  if [[ ! -d $DATA ]]; then
    echo "no real data: $DATA does not exist (set DPLIT_DATA_DIR to the shared data folder)"
  elif [[ ! -f $DATA/$GGUF ]]; then
    echo "no SmolLM2 checkpoint: $DATA/$GGUF does not exist"
  elif [[ ! -f $DATA/glue/sst2/train.tsv || ! -f $DATA/glue/sst2/dev.tsv ]]; then
    echo "no GLUE SST-2: $DATA/glue/sst2/train.tsv or dev.tsv does not exist"
  elif ! grep -q '"gguf": "' "$OUT/machine.json"; then
    echo "the gguf package is not installed (pip install -e '.[gguf]'): the SmolLM2 GGUF cannot be loaded"
  fi
}

bench_command() {  # part model seq_len row_timeout: sets CMD to bench.run for that size in bf16-mixed on CUDA
  CMD=("$PYTHON" -m bench.run --models "$2" --batch-sizes 16 --seq-len "$3" --device cuda --precision bf16-mixed
       --configs "${BENCH_CONFIGS[@]}" --warmup 3 --steps 5 --timeout "$4" --out "$OUT/$1" --logs "$OUT/$1/logs")
}

fsdp_command() {  # sets CMD to bench.fsdp on CUDA at world size 1, and also 2 where there are 2+ GPUs
  local run=("$PYTHON" -m bench.fsdp --size smollm2 --batch-size 8 --seq-len 64 --warmup 1 --steps 2 --device cuda)
  local gpus
  gpus=$("$PYTHON" -c 'import json, sys; print(len(json.load(open(sys.argv[1])).get("cuda_devices") or []))' \
    "$OUT/machine.json" 2>/dev/null || echo 0)
  if (( gpus >= 2 )); then  # one after the other in one part: world size 1 into fsdp_smoke/, 2 into world2/
    CMD=(bash -c '"$@" --world-size 1 --out "$0" && "$@" --world-size 2 --out "$0/world2"' "$OUT/fsdp_smoke"
         "${run[@]}")
  else
    CMD=("${run[@]}" --world-size 1 --out "$OUT/fsdp_smoke")
  fi
}

part() {  # name: sets CMD to the part's command
  case $1 in
    tests) CMD=("$PYTHON" -m pytest -m gpu -q -n 0 --junitxml="$OUT/tests.junit.xml") ;;  # one process: one GPU
    bench_gpt2) bench_command bench_gpt2 gpt2 128 60 ;;
    bench_smollm2) bench_command bench_smollm2 smollm2 64 70 ;;
    fsdp_smoke) fsdp_command ;;
    memory_smoke) CMD=("$PYTHON" -m bench.memory --device cuda --size smollm2 --batch-size 8 --seq-len 512 --warmup 1
                       --steps 2 --out "$OUT/memory_smoke") ;;
    packing) CMD=("$PYTHON" -m bench.packing --device cuda --model gpt2 smollm2 --row 512 1024 --documents 128
                  --micro 32 --repeats 1 --out "$OUT/packing") ;;
    tying) CMD=("$PYTHON" -m bench.tying --full --seeds 0 --epsilons 8 --arms dp_tied dp_untied
                --train-examples 4096 --epochs 1 --batch-size 512 --physical-batch-size 128 --accelerator gpu
                --precision bf16-mixed --timeout 75 --data-root "$DATA" --out "$OUT/tying" --logs "$WORK/tying/runs") ;;
  esac
}

after_bench() {  # part: a suite stopped early has results.json but no table: render the rows it measured
  if [[ -f $OUT/$1/results.json && ! -f $OUT/$1/table.md ]]; then
    timeout 60 "$PYTHON" -m bench.report "$OUT/$1" </dev/null >>"$OUT/$1.log" 2>&1
  fi
}

after_tying() {  # each arm's console output beside the results (the Lightning logs stay in $WORK)
  mkdir -p "$OUT/tying/logs"
  for log in "$WORK"/tying/runs/*/output.log; do
    [[ -f $log ]] && cp -- "$log" "$OUT/tying/logs/$(basename "$(dirname "$log")").log"
  done
}

echo "dplit gpu.sh: results in $OUT; budget ${TOTAL} s"
for name in tests bench_gpt2 bench_smollm2 tying fsdp_smoke memory_smoke packing; do
  part "$name"
  if (( ! CUDA )); then
    skip "$name" "$NO_CUDA_REASON" "${CMD[@]}"
  elif [[ $name == tying && -n $(tying_problem) ]]; then
    skip "$name" "$(tying_problem)" "${CMD[@]}"
  else
    run_part "$name" "${CMD[@]}"
    case $name in bench_*) after_bench "$name" ;; tying) after_tying ;; esac
  fi
done

write_summary true
rm -f "$PARTS"
EXIT=$("$PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1]))["exit_code"])' "$OUT/summary.json" \
  2>/dev/null || echo 1)
echo "dplit gpu.sh: done in $(( $(date +%s) - START )) s, exit $EXIT; see $OUT/summary.md"
exit "$EXIT"
