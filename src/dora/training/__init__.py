"""The policy trained and measured outside the RL loop, where models meet tasks and rewards:
the supervised warm start (``warmstart``) and evaluation on a task's held-out problems
(``evaluate``). Kept apart from ``dora.models``, which knows neither tasks nor rewards."""
