"""D's wing: receive tasks and their phases, the producers D talks to, fenced pulls, pushes, settling, heartbeats."""
