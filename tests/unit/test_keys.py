"""CURVE keys and the ZAP decision (kvps/wire/keys.py, kvps/wire/auth.py): secret files are private
and never overwritten, the policy says when CURVE is on and errors say what to do, the gate admits
only the job's keys under their names, and two Vans in one process check `src` against the key."""
import json
import os
import stat
import threading

import pytest
import zmq

from kvps import cli
from kvps.config import Config
from kvps.errors import ConfigError
from kvps.wire.auth import Gate
from kvps.wire.keys import for_node, job_names, make_job_keys
from kvps.wire.protocol import Header, Op
from kvps.wire.transport import Van


@pytest.fixture
def job(tmp_path):
    return make_job_keys(str(tmp_path / "keys"), job_names(2, 1))


def cfg(**env):
    return Config.from_env({k: str(v) for k, v in env.items()})


def test_each_node_gets_a_private_file_with_its_secret_and_every_public_key(job):
    assert sorted(job) == ["H", "S0", "W0", "W1"]
    publics = set()
    for name, path in job.items():
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        content = json.load(open(path))
        assert list(content["secret"]) == [name] and sorted(content["public"]) == sorted(job)
        assert zmq.curve_public(content["secret"][name].encode()).decode() == content["public"][name]
        publics.add(tuple(sorted(content["public"].items())))
    assert len(publics) == 1                    # one job: every file lists the same public keys


def test_a_launchers_keys_go_to_a_private_temporary_directory():
    paths = make_job_keys(None, ["H", "W0"])
    assert stat.S_IMODE(os.stat(os.path.dirname(paths["H"])).st_mode) == 0o700


def test_keys_are_never_overwritten_and_a_refused_call_writes_nothing(tmp_path, job):
    before = {p: open(p).read() for p in job.values()}
    with pytest.raises(ConfigError, match="never overwrites keys"):
        make_job_keys(str(tmp_path / "keys"), job_names(3, 1))          # W2 is new, the others exist
    assert not os.path.exists(tmp_path / "keys" / "W2.json")
    assert {p: open(p).read() for p in job.values()} == before
    with pytest.raises(ConfigError, match="ASCII letters and digits"):
        make_job_keys(str(tmp_path / "k2"), ["../H"])


def test_kvps_keys_new_writes_the_files_for_daemons_started_by_hand(tmp_path, capsys):
    assert cli.main(["keys", "new", str(tmp_path / "k"), "-n", "2", "-s", "1"]) == 0
    assert sorted(os.listdir(tmp_path / "k")) == ["H.json", "S0.json", "W0.json", "W1.json"]
    secret = json.load(open(tmp_path / "k" / "W0.json"))["secret"]["W0"]
    assert secret not in capsys.readouterr().out                        # names the files, prints no key
    assert cli.main(["keys", "new", str(tmp_path / "k"), "-n", "1"]) == 2
    assert "never overwrites keys" in capsys.readouterr().err


def test_curve_is_off_for_a_loopback_job_and_required_beyond_it():
    assert for_node(cfg(), "worker", 0, ["127.0.0.1", None]) is None
    with pytest.raises(ConfigError, match=r"beyond this machine \(10\.0\.0\.1\).*kvps keys new.*KVPS_CURVE=0"):
        for_node(cfg(), "worker", 0, ["10.0.0.1"])
    with pytest.raises(ConfigError, match="because KVPS_CURVE=1"):
        for_node(cfg(KVPS_CURVE=1), "scheduler", None, ["127.0.0.1"])
    assert for_node(cfg(KVPS_CURVE=0), "server", 0, ["0.0.0.0", "10.0.0.1"]) is None
    with pytest.raises(ConfigError, match="KVPS_CURVE='yes' must be auto, 0 or 1"):
        cfg(KVPS_CURVE="yes")


def test_a_node_loads_its_own_key_by_name_or_from_its_file(job):
    keys = for_node(cfg(KVPS_SECRET_FILE=job["W1"]), "worker", 1, ["127.0.0.1"])     # given keys: CURVE on
    assert keys.name == "W1" and sorted(keys.peers) == ["H", "S0", "W0", "W1"]
    assert for_node(cfg(KVPS_SECRET_FILE=job["S0"]), "server", -1, ["127.0.0.1"]).name == "S0"   # rank from file
    assert for_node(cfg(KVPS_SECRET_FILE=job["H"]), "scheduler", None, ["0.0.0.0"]).name == "H"
    with pytest.raises(ConfigError, match="holds the secret key of W1, not of W0"):
        for_node(cfg(KVPS_SECRET_FILE=job["W1"]), "worker", 0, ["127.0.0.1"])
    with pytest.raises(ConfigError, match="have no public key for node 'S7'"):
        keys.peer("S7")


def test_the_secret_may_come_in_the_environment_and_never_shows_in_the_config(job):
    text = open(job["W0"]).read()
    config = cfg(KVPS_SECRET=text)
    assert for_node(config, "worker", 0, ["10.0.0.1"]).name == "W0"
    assert "secret=" not in repr(config) and json.loads(text)["secret"]["W0"] not in repr(config)


def test_bad_secret_files_are_refused_naming_the_file_and_the_fix(tmp_path, job):
    os.chmod(job["W0"], 0o644)
    with pytest.raises(ConfigError, match=r"has mode -rw-r--r--.*chmod 600"):
        for_node(cfg(KVPS_SECRET_FILE=job["W0"]), "worker", 0, ["127.0.0.1"])
    path = tmp_path / "bad.json"
    for content, match in (("{", "is not JSON"), ('{"kvps": "other"}', "is not a kvps key file"),
                           ('{"kvps": "curve-keys/1", "public": {"H": "short"}, "secret": {"H": "x"}}',
                            "40-character Z85 keys")):
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, content.encode())
        os.close(fd)
        with pytest.raises(ConfigError, match=match):
            for_node(cfg(KVPS_SECRET_FILE=str(path)), "scheduler", None, ["127.0.0.1"])
    mixed = json.load(open(job["W1"]))
    mixed["public"]["W1"] = json.load(open(job["W0"]))["public"]["W0"]
    path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, json.dumps(mixed).encode())
    os.close(fd)
    with pytest.raises(ConfigError, match="does not belong to its secret key"):
        for_node(cfg(KVPS_SECRET_FILE=str(path)), "worker", 1, ["127.0.0.1"])
    with pytest.raises(ConfigError, match="No such file"):
        for_node(cfg(KVPS_SECRET_FILE=str(tmp_path / "none.json")), "worker", 1, ["127.0.0.1"])


def test_the_gate_admits_the_jobs_keys_under_their_names_only(job):
    keys = for_node(cfg(KVPS_SECRET_FILE=job["H"]), "scheduler", None, ["127.0.0.1"])
    gate = Gate(keys.peers)
    w1 = zmq.utils.z85.decode(keys.peers["W1"])
    reply, refusal = gate.answer([b"1.0", b"7", b"kvps", b"10.0.0.9", b"", b"CURVE", w1])
    assert reply == [b"1.0", b"7", b"200", b"OK", b"W1", b""] and refusal is None
    stranger = zmq.utils.z85.decode(zmq.curve_keypair()[0])
    reply, refusal = gate.answer([b"1.0", b"8", b"kvps", b"10.0.0.9", b"", b"CURVE", stranger])
    assert reply[2] == b"400" and "10.0.0.9" in refusal and "not one of this job's" in refusal
    assert gate.answer([b"1.0", b"9", b"kvps", b"10.0.0.9", b"", b"NULL"])[0][2] == b"400"
    assert gate.answer([b"1.0", b"9"])[0][2] == b"500"


def test_two_vans_check_every_src_against_the_senders_key(job):
    load = lambda name, role, rank: for_node(cfg(KVPS_SECRET_FILE=job[name]), role, rank, ["127.0.0.1"])
    got, replies = [], []
    arrived = threading.Event()
    server = Van("S0", lambda source, header, payloads: (got.append(header.src), arrived.set()))
    server.secure(load("S0", "server", 0))
    port = server.bind("127.0.0.1")
    server.start()
    client = Van("W1", lambda source, header, payloads: (replies.append(header), arrived.set()))
    client.secure(load("W1", "worker", 1))
    client.start()
    ctx = zmq.Context()
    plain = ctx.socket(zmq.DEALER)
    try:
        client.connect("S0", "127.0.0.1", port)
        client.send("S0", Header(Op.HEARTBEAT, 0, "W1"))
        assert arrived.wait(10) and got == ["W1"]
        arrived.clear()
        client.send("S0", Header(Op.PULL, 5, "W0"))          # W1's key, W0's name
        assert arrived.wait(10) and got == ["W1"]
        assert replies[0].op == Op.ERROR and replies[0].id == 5
        assert "claims to come from 'W0', but its sender's key is W1's" in replies[0].meta["message"]
        plain.setsockopt(zmq.LINGER, 0)
        plain.connect(f"tcp://127.0.0.1:{port}")
        plain.send_multipart([Header(Op.HEARTBEAT, 0, "W0").encode()])
        assert not plain.poll(500) and got == ["W1"]          # no keys: no answer, nothing handled
        with pytest.raises(ConfigError, match="no public key for node 'S3'"):
            client.connect("S3", "127.0.0.1", port)
    finally:
        plain.close(0)
        ctx.term()
        client.stop()
        server.stop()
