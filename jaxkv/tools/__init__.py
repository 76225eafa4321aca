"""The harness: model/engine builders, workloads, online load, lowering checks, the roofline,
capacity planning and the benchmarks. Nothing on the serving path imports these."""
