# queue-ref certify: the HTML certificate rendered by headless chromium, kept as a PNG.
.PHONY: certificate-screenshot
certificate-screenshot: setup
	rm -f $(CURDIR)/certificate.png
	QUEUE_REF_SCREENSHOT=$(CURDIR)/certificate.png $(BIN)/pytest -q -rs \
	  tests/test_conformance_certify.py -k headless_browser
	@test -s $(CURDIR)/certificate.png && echo "screenshot: certificate.png" \
	  || { echo "no screenshot: the test was skipped (see above)"; exit 1; }
