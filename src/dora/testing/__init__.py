"""Doubles for tests and benchmarks, importable in your own tests too: a learner stand-in
that consumes and publishes versions without training (``learner_standin``), timing-model
engines from a length trace (``emulated_engine``, ``emulated_trace``), and the emulated fleet
of real generator processes on those engines (``emulated_workers``, ``emulated_fleet``) that
``dora bench modes --fleet emulated`` runs. None of it is used by a pipeline."""
