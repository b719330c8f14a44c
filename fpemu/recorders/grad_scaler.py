"""What a torch GradScaler was built with, read back from the object itself (no torch import needed)."""


def grad_scaler_params(scaler) -> dict:
    """``scaler``'s constructor parameters as it holds them (torch.amp.GradScaler keeps them as private
    attributes; reading them back names what really ran, not what a caller believes it passed)."""
    return {"init_scale": scaler._init_scale, "growth_factor": scaler._growth_factor,
            "backoff_factor": scaler._backoff_factor, "growth_interval": scaler._growth_interval}
