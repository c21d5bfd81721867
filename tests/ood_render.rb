# Renders an Open OnDemand batch-connect app the way OnDemand does, without OnDemand (tests/cluster/test_ood.py):
# ERB with trim_mode "-", form values as strings, reachable as bare names (submit.yml.erb, view.html.erb) and as
# `context.NAME` (template/*.erb).  An exception raised by a template is what OnDemand shows above the form:
# it is printed as "ERROR: message" and the exit status is 3.
#
#   ruby tests/ood_render.rb VALUES.json APP_DIR OUT_DIR
# writes OUT_DIR/form.json and OUT_DIR/submit.json (the YAML, parsed) and OUT_DIR/template/* (".erb" dropped,
# file modes kept).  VALUES.json maps form attributes to strings.
#   ruby tests/ood_render.rb VALUES.json FILE.erb   prints one rendered file (e.g. view.html.erb).
require "erb"
require "json"
require "yaml"
require "fileutils"

class FormContext
  def initialize(values)
    @values = values
  end

  def context
    self
  end

  def method_missing(name, *args)
    @values.key?(name.to_s) ? @values[name.to_s].to_s : super
  end

  def respond_to_missing?(name, include_private = false)
    @values.key?(name.to_s) || super
  end

  def render(path)
    ERB.new(File.read(path), trim_mode: "-").result(binding)
  end
end

values = JSON.parse(File.read(ARGV[0]))
ctx = FormContext.new(values)
begin
  if ARGV.length == 2
    print ctx.render(ARGV[1])
    exit 0
  end
  app, out = ARGV[1], ARGV[2]
  FileUtils.mkdir_p(File.join(out, "template"))
  File.write(File.join(out, "form.json"), JSON.generate(YAML.safe_load(ctx.render(File.join(app, "form.yml.erb")))))
  File.write(File.join(out, "submit.json"), JSON.generate(YAML.safe_load(ctx.render(File.join(app, "submit.yml.erb")))))
  Dir.glob(File.join(app, "template", "*")).each do |src|
    dest = File.join(out, "template", File.basename(src).delete_suffix(".erb"))
    File.write(dest, src.end_with?(".erb") ? ctx.render(src) : File.read(src))
    File.chmod(File.stat(src).mode & 0o777, dest)
  end
rescue StandardError => e
  warn "ERROR: #{e.message}"
  exit 3
end
