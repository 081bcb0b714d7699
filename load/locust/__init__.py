"""Locust load tests: the users, their payload checks and the headless runner."""
