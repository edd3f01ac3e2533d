# queue-ref certify: the HTML certificate rendered by headless chromium, kept as a PNG.
.PHONY: certificate-screenshot
certificate-screenshot: setup
	QUEUE_REF_SCREENSHOT=$(CURDIR)/certificate.png $(BIN)/pytest -q \
	  tests/test_conformance_certify.py -k headless_browser
	@echo "screenshot: certificate.png"
