"""A multi-turn verifiers env written for the tests (verifiers 0.4, `verifiers.v1`; env id
`vf_again`): the agent answers the task's prompt, the env says "Again, shorter." and the agent
answers once more; `finalize` records the number of turns on the trace."""

import verifiers.v1 as vf

AGAIN = "Again, shorter."


class AgainEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()


class AgainEnv(vf.Env[AgainEnvConfig]):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as exchange:
            first = await exchange.turn()
            if not first.terminated:
                await exchange.turn(AGAIN)

    async def finalize(self, task, episode):
        for trace in episode.traces:
            trace.record_metric("env_turns", float(trace.num_turns))


__all__ = ["AgainEnv"]
