"""After training: HellaSwag accuracy (`python -m evals.hellaswag`) and loss curves (`python -m evals.plot`)."""
