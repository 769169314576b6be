"""The `stepahead` command (`commands`), and `stepahead serve` (`serve`): a worker and a
scheduler in one command."""
