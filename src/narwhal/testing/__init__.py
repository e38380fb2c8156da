"""The shared harness of the tests, the benchmarks, the demo and the tools: processes
(``procs``), free ports (``ports``), /proc readings (``procfs``), statistics (``stats``) and the
local simulated fleet (``fleet``, with the ``narwhal-sim`` console script in ``sim_cli``)."""
