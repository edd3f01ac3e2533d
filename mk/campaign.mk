# queue-ref campaign (Spark): the report page rendered by headless chromium, kept as a PNG.
.PHONY: campaign-screenshot
campaign-screenshot: setup
	QUEUE_REF_SCREENSHOT=$(CURDIR)/campaign-report.png $(BIN)/pytest -q \
	  tests/test_campaign_spark.py -k headless_browser
	@echo "screenshot: campaign-report.png"
