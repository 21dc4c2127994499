"""The HTTP endpoint a node serves when KVPS_METRICS_PORT is set: /metrics in the Prometheus text
format (prometheus-client's generate_latest), and on the scheduler /targets, the job's nodes in
Prometheus's HTTP service-discovery format.

    endpoint = Endpoint(metrics.registry, "127.0.0.1", 0, targets=None)   # port 0: a free one
    endpoint.port; endpoint.stop()

It runs on threads of its own (http.server), so a scrape never waits for, or delays, the node's I/O
thread: it reads the counters, which are plain numbers, without taking the node's locks. Any other
path is a 404. Requests are small GETs; the server reads no request body.
"""
import http.server
import json
import logging
import threading

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvps.errors import ConfigError

log = logging.getLogger("kvps.metrics")

STOP_POLL = 0.25        # seconds: how often the serving loop looks for stop()


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class Endpoint:
    """/metrics (and /targets when `targets` is given: a callable returning the SD list)."""

    def __init__(self, registry, host, port, targets=None):
        class Handler(http.server.BaseHTTPRequestHandler):
            timeout = 10                       # seconds a client may take to send its request

            def do_GET(self):
                path = self.path.split("?", 1)[0]
                try:
                    if path in ("/metrics", "/"):
                        body, kind = generate_latest(registry), CONTENT_TYPE_LATEST
                    elif path == "/targets" and targets is not None:
                        body, kind = json.dumps(targets()).encode(), "application/json"
                    else:
                        self.send_error(404, "kvps serves /metrics" + (" and /targets" if targets else ""))
                        return
                except Exception:
                    log.exception("metrics: serving %s failed", path)
                    self.send_error(500)
                    return
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format, *args):     # scrapes every second would flood stderr
                pass

        try:
            self._server = _Server((host, port), Handler)
        except OSError as exc:
            raise ConfigError(f"KVPS_METRICS_PORT={port}: cannot serve metrics on {host}:{port} "
                              f"({exc.strerror}); use 0 for any free port") from None
        self.host = host
        self.port = self._server.server_address[1]
        self.targets = targets
        self._thread = threading.Thread(target=self._server.serve_forever, args=(STOP_POLL,),
                                        name="kvps-metrics", daemon=True)
        self._thread.start()

    @property
    def address(self):
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"{host}:{self.port}"

    def stop(self):
        """Stop serving (waits at most about STOP_POLL s); safe to call twice."""
        if self._thread is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread = None
