"""Named int32 arrays written on the host and sent to the device in one transfer: views into one
int32 device buffer and its pinned host twin (a graph's static inputs, refilled every step)."""

import math

import torch


class StagingBuffer:
    """`host[name]` (numpy, pinned) is what the host writes; `dev[name]` (torch, on the device)
    the same part of the device buffer, what a captured graph reads. A part's size is an int, or
    a shape for a 2-D part."""

    def __init__(self, parts: dict[str, int | tuple[int, ...]], device):
        shapes = {name: n if isinstance(n, tuple) else (n,) for name, n in parts.items()}
        total = sum(math.prod(shape) for shape in shapes.values())
        self.device_buf = torch.zeros(total, dtype=torch.int32, device=device)
        self.host_buf = torch.zeros(total, dtype=torch.int32).pin_memory()
        self.dev, self.host, at = {}, {}, 0
        for name, shape in shapes.items():
            n = math.prod(shape)
            self.dev[name] = self.device_buf[at : at + n].view(shape)
            self.host[name] = self.host_buf.numpy()[at : at + n].reshape(shape)
            at += n
        self.copied = torch.cuda.Event()

    def wait_sent(self) -> None:
        """Block until the last `send` has left the host buffer: only then may it be rewritten."""
        self.copied.synchronize()

    def send(self) -> None:
        """Copy the host buffer to the device, asynchronously on the current stream."""
        self.device_buf.copy_(self.host_buf, non_blocking=True)
        self.copied.record()

    def send_now(self) -> None:
        """Copy the host buffer to the device, returning once it is there."""
        self.device_buf.copy_(self.host_buf)
