"""scenarios: run small DDP trainings on several ranks, inject faults, measure the checks."""
