"""The reproduction framework: what ``python -m dgc.train`` and the Makefile targets run.

* :mod:`~dgc.repro.config`: the typed configuration Hydra composes (``conf/``);
* :mod:`~dgc.repro.trainer`: one training loop for every task and compressor;
* :mod:`~dgc.repro.rundir`: the run directory (config, metrics, checkpoints, summary);
* :mod:`~dgc.repro.tables`, :mod:`~dgc.repro.sweep`, :mod:`~dgc.repro.report`: the paper's tables,
  the runs that make them, and the reports (``python -m dgc.repro.sweep|report``);
* :mod:`~dgc.repro.demo`: ``make demo``;
* :mod:`~dgc.repro.presets`: the ``conf/compression`` presets outside Hydra (for the benchmarks and the demo);
* :mod:`~dgc.repro.faults`: test-only fault injection.

Tasks (models, data, metrics) live in ``tasks/``, installed as :mod:`dgc.tasks`.
"""

from dgc.extras import require

require("repro", "dgc.repro (the reproduction framework)")
