"""A verifiers env for the tests (env id `vf_idle`) whose episode plays no trainable agent: its
one agent is marked untrainable in `setup` and never run."""

import verifiers.v1 as vf


class IdleEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()


class IdleEnv(vf.Env[IdleEnvConfig]):
    async def setup(self, agents):
        agents.agent.trainable = False

    async def run(self, task, agents):
        return None


__all__ = ["IdleEnv"]
