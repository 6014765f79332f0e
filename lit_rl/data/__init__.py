"""Where tokens come from: rendering chats to assistant-only masks, packing, datamodules."""

from lit_rl.data.render import RenderedChat, RenderError, render_messages
from lit_rl.data.samples import Sample, SampleGroup

__all__ = ["RenderError", "RenderedChat", "Sample", "SampleGroup", "render_messages"]
