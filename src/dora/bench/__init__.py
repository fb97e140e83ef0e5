"""Benchmarks behind ``dora bench ...``: each prints a rich table and saves its rows as JSON
(``dora.bench.report.save_rows``), comparing against a baseline measured in the same run."""
