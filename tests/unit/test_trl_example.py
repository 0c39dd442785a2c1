"""`examples/trl_grpo.py`'s docstring names exactly the flags its parser takes."""

from __future__ import annotations

import argparse
import re

import examples.trl_grpo as example


def _parser_flags() -> set[str]:
    return {
        o
        for a in example.parser()._actions
        if a.help is not argparse.SUPPRESS
        for o in a.option_strings
        if o.startswith("--") and o != "--help"
    }


def test_the_example_docstring_lists_every_flag_and_only_real_ones():
    doc = example.__doc__ or ""
    usage = doc[doc.index("python -m examples.trl_grpo") : doc.index("The trainer is")]
    section = doc[doc.index("Flags:") : doc.index("What is recorded")]
    flags = _parser_flags()
    assert set(re.findall(r"--[a-z][a-z-]*", usage)) == flags
    assert set(re.findall(r"`(--[a-z][a-z-]*)", section)) == flags


def test_a_refused_label_read_names_the_status_and_the_servers_reason():
    """A server started without --enable-scale-out refuses the token-in-token-out route
    (HTTP 403); the example's error carries the server's body and the flag to pass, not
    urllib's bare 'HTTP Error 403: Forbidden'. A real HTTP server on loopback."""
    import http.server
    import threading

    class Refuse(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = (
                b'{"message": "Scale-out endpoints are disabled. Restart vllm serve with ...", "code": 403}'
            )
            self.send_response(403)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        try:
            example.generation_label(url)
        except Exception as e:  # the type is part of what is checked below
            err = e
        else:
            raise AssertionError("a 403 was taken as an answer")
    finally:
        server.shutdown()
        server.server_close()
        t.join(5)
    assert type(err).__name__ == "ServerError", repr(err)
    text = str(err)
    assert "HTTP 403" in text and "Scale-out endpoints are disabled" in text and "--enable-scale-out" in text
