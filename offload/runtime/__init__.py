"""What runs during training, below the user's Engine: the prefetch schedule, the
timeline, the loss scaler and the engine's lifecycle helpers, and the collaborators the
Engine is wired from."""
