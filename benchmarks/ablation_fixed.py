"""AMPD Fig. 5 ablation: DuReader and GAIA, seeds 0-2, rates 0.8 and 2, on AMPD's Fig. 4 deployments."""
from tandem.bench.experiment import preset, run_experiment
spec = preset("ablation", seeds=[0, 1, 2], rates=[0.8, 2.0], jobs=2,
              deploys={"dureader/ampd": "P:tp4x2,D:tp8x1", "gaia/ampd": "P:tp8x1,D:tp8x3"})
res = run_experiment(spec, "reports/ablation", progress=False)
for c in res["cells"]:
    print(c["workload"], c["rate"], c["policy"], c["deploy"], "slo=%.3f" % c["slo_attainment"],
          "round=%.3f" % c["round_slo_attainment"], "local=%.3f" % c["local_prefill_fraction"],
          "ttft_inc_p95=%.2f" % c["ttft_incremental_p95_s"], "itl=%.4f" % c["itl_mean_s"])
