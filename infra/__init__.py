"""Deployments, schedules, and the scripts that start servers (Prefect server, workers)."""
