"""The application: CLI, config, the coordinator and volunteer roles."""
