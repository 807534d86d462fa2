"""What a request asks for and what it gets back: sampling parameters, penalties, structured outputs,
logprobs, output and detokenization. Light: no torch at import (the server's protocol reads the bounds)."""
