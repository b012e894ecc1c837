"""The name and one-line help of every `tandem` command, in the order `tandem --help` lists them: the top-level parser
lists every command from here without importing the modules that build their flags (tandem.cli.main imports only
the chosen command's module, so a command starts without the others' imports)."""
from __future__ import annotations

COMMAND_HELP: dict[str, str] = {
    "simulate": "simulate one workload on one deployment with one policy",
    "generate": "write a workload (generator or public trace) as a session JSONL file",
    "experiment": "sweep workloads x policies x rates (AMPD Fig. 4/5) and write a report",
    "plan": "choose prefill/decode workers and TP degrees for a GPU budget (AMPD planner)",
    "tiny-model": "write a tiny Qwen3/Llama/SDAR/LLaDA checkpoint (HF layout) for tests",
    "profile": "measure the engine's step times on this device and fit its cost model",
    "serve": "serve a model over the OpenAI API with prefill/decode worker processes",
    "demo": "serve a tiny model 1P+1D with AMPD and a baseline, replay multi-round sessions through HTTP at a load "
            "calibrated to this machine, compare with the simulator",
    "bench": "replay multi-round sessions against an OpenAI-compatible server",
}
