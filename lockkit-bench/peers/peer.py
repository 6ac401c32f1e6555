"""Peer lock clients for lockkit's peer benchmark (`scripts/perf.sh`).

    python peer.py redis redis://127.0.0.1:16379
    python peer.py kazoo 127.0.0.1:12181

Reads one command per line on stdin and answers each with one JSON line on stdout:

    same N          N uncontended acquire+release on one key       -> {"us": [...]}
    new N           N uncontended acquire+release, a new key each   -> {"us": [...]}
    wake R          R times: a holder releases, one blocked waiter
                    takes the key; release call to grant             -> {"us": [...]}
    handoff W R     W clients take one key R times each; release
                    call to the next grant                           -> {"us": [...]}
    quit

Each library is used as its documentation shows: redis-py's `Lock` (blocking acquire polls
with its default 0.1 s sleep), kazoo's `Lock` (one session per contender).
"""

import json
import random
import sys
import threading
import time
import uuid

RUN = uuid.uuid4().hex[:8]


def now():
    return time.perf_counter()


def micros(seconds):
    return round(seconds * 1e6, 1)


class RedisPeer:
    def __init__(self, url):
        import redis

        self.redis = redis
        self.url = url
        self.client = redis.Redis.from_url(url)
        self.client.ping()

    def new_client(self):
        return self.redis.Redis.from_url(self.url)

    def lock(self, client, key):
        return client.lock("peerbench/" + key, timeout=30, blocking_timeout=120)

    def close(self, client):
        client.close()


class KazooPeer:
    def __init__(self, hosts):
        from kazoo.client import KazooClient

        self.KazooClient = KazooClient
        self.hosts = hosts
        self.client = self.new_client()

    def new_client(self):
        client = self.KazooClient(hosts=self.hosts)
        client.start(timeout=30)
        return client

    def lock(self, client, key):
        return client.Lock("/peerbench/" + key, "peerbench")

    def close(self, client):
        client.stop()
        client.close()


def uncontended(peer, n, new_key):
    samples = []
    for i in range(n):
        key = "%s/new/%d" % (RUN, i + uncontended.counter) if new_key else RUN + "/same"
        start = now()
        lock = peer.lock(peer.client, key)
        if not lock.acquire():
            raise RuntimeError("uncontended acquire failed")
        lock.release()
        samples.append(micros(now() - start))
    uncontended.counter += n
    return samples


uncontended.counter = 0


def wake(peer, rounds):
    holder_client, waiter_client = peer.client, peer.new_client()
    samples = []
    try:
        for r in range(rounds):
            key = "%s/wake/%d" % (RUN, r)
            held = peer.lock(holder_client, key)
            if not held.acquire():
                raise RuntimeError("wake: holder acquire failed")
            granted = {}

            def wait():
                lock = peer.lock(waiter_client, key)
                if lock.acquire():
                    granted["at"] = now()
                    lock.release()

            waiter = threading.Thread(target=wait)
            waiter.start()
            # The waiter is blocked by now; a random phase, so a polling client's sleep
            # is not in step with the release.
            time.sleep(0.2 + random.random() * 0.1)
            released = now()
            held.release()
            waiter.join(120)
            if "at" not in granted:
                raise RuntimeError("wake: the waiter was never granted")
            samples.append(micros(granted["at"] - released))
    finally:
        peer.close(waiter_client)
    return samples


def handoff(peer, waiters, rounds):
    key = "%s/hot/%s" % (RUN, uuid.uuid4().hex[:6])
    clients = [peer.new_client() for _ in range(waiters)]
    state = {"released": None}
    samples = []
    guard = threading.Lock()
    errors = []

    def run(client):
        try:
            for _ in range(rounds):
                lock = peer.lock(client, key)
                if not lock.acquire():
                    raise RuntimeError("handoff acquire timed out")
                granted = now()
                with guard:
                    if state["released"] is not None:
                        samples.append(micros(granted - state["released"]))
                        state["released"] = None
                    state["released"] = now()
                lock.release()
        except Exception as e:  # reported to the caller
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in clients:
        peer.close(c)
    if errors:
        raise RuntimeError(errors[0])
    return samples


def main():
    kind, address = sys.argv[1], sys.argv[2]
    peer = RedisPeer(address) if kind == "redis" else KazooPeer(address)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        try:
            if words[0] == "quit":
                break
            if words[0] == "same":
                out = uncontended(peer, int(words[1]), False)
            elif words[0] == "new":
                out = uncontended(peer, int(words[1]), True)
            elif words[0] == "wake":
                out = wake(peer, int(words[1]))
            elif words[0] == "handoff":
                out = handoff(peer, int(words[1]), int(words[2]))
            else:
                raise ValueError("unknown command " + words[0])
            print(json.dumps({"us": out}), flush=True)
        except Exception as e:
            print(json.dumps({"error": repr(e)}), flush=True)


if __name__ == "__main__":
    main()
