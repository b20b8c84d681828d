"""What each command's ``--help`` says beyond its one line: what it does, and its exit statuses
(a service manager, a script and a volunteer all read them; before, exit status 3 was written
only in docs/verification.md)."""

from __future__ import annotations

import argparse

_ALWAYS = (
    "130 stopped by Ctrl+C (a node keeps its last finished round's checkpoint); 143 stopped by "
    "SIGTERM (systemd, docker stop), cleanly as Ctrl+C"
)

DESCRIPTIONS = {
    "id": "Print the peer id of an Ed25519 identity, creating the key file (mode 0600) if it "
    "is absent; with --work, make it with proof of work for a run whose spec asks for some "
    "(run.identity_work_bits).",
    "relay": "Run a public helper peer: bootstrap for the DHT, DHT server, circuit relay for "
    "peers behind NATs, and dial-back service that tells peers whether they are reachable. "
    "Runs until stopped.",
    "doctor": "Check this machine as a peer: identity, listen and observed addresses, "
    "reachability (through --join's helpers), relay slots, the bulk data listener, and each "
    "--ping peer (found through the DHT: direct or relayed, round trip, bulk MiB/s).",
    "node": "Join a run as a volunteer: fetch the coordinator's signed run spec, check the "
    "local data and model against it, catch up with the swarm's agreed state, then train "
    "inner phases and average each round with the other peers until the spec's last round. "
    "A restart with the same --state-dir resumes from the last round's checkpoint.",
    "export": "Write a node's trained model (its newest checkpoint) as safetensors, or as a "
    "save_pretrained folder for a transformers model.",
    "init": "Write a commented default run config (run.toml): every key, its default and what "
    "it does.",
    "coordinator": "Create a run from run.toml, sign its spec with this identity, and serve as "
    "its bootstrap, DHT server, relay and (verified runs) referee; with --dashboard-port, a "
    "live web page of the run. Runs until stopped. 'coordinator token' signs a join token for "
    "a token run.",
    "status": "Read a run's progress from the DHT: its peers, their round, loss, throughput, "
    "state hash agreement and connection kind, and the agreed state.",
    "local": "A whole swarm on this machine: a coordinator and N volunteer processes on "
    "loopback, the embedded default run or --config's spec; a summary (and --json) at the end.",
    "verify": "Run a training task on two providers (one may cheat with --cheat-step and "
    "--cheat-op) and let a referee settle their dispute by bisection over the RepOps trace.",
}

EXIT_STATUSES = {
    "id": "0 printed; 1 the key file cannot be read or made, or has less work than --work",
    "relay": "1 bad flag or the port is busy",
    "doctor": "0 every check passed; 1 a check failed (the report says which) or a bad flag",
    "node": "0 the run's last round is done; 1 bad flag, spec refused, data or model not the "
    "spec's, cannot join (one line says why); 3 banned by the run's referee",
    "export": "0 written; 1 no checkpoint, or the output cannot be written",
    "init": "0 written; 1 the file exists (--force) or cannot be written",
    "coordinator": "1 bad config or flag, or a port is busy",
    "status": "0 reported; 1 the coordinator cannot be reached or its spec is refused",
    "local": "0 every node finished and their states agree; 1 a node failed",
    "verify": "0 the providers agreed, or the referee named the cheater; 1 no verdict; 2 bad "
    "flag, or a provider failed to start",
}


def describe(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Give every command in ``sub`` its description and exit statuses (every command stops on
    Ctrl+C and SIGTERM alike: ``swarmtrain.cli.main``)."""
    for name, parser in sub.choices.items():
        parser.description = DESCRIPTIONS.get(name, parser.description)
        if name in EXIT_STATUSES:
            parser.epilog = f"exit status: {EXIT_STATUSES[name]}; {_ALWAYS}"
