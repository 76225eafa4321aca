"""The engine (the facade a user drives) and the service that runs its loop on a thread."""
