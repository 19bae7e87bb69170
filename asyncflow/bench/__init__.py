"""``asyncflow bench``: sync vs stream vs async on the same resources (:mod:`~asyncflow.bench.run`),
against bounds from each role run alone (:mod:`~asyncflow.bench.solo`)."""
